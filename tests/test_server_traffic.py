"""The HTTP server under traffic, end to end: real sockets on 127.0.0.1, real engines behind them.

Clients that go away mid-request, several models under one budget, and ``/metrics`` as requests go. Every
wait is on the engine's state (its stats, a stream's events, ``/metrics``), never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aioengine import SamplingParams
from tests.helpers import last_output
from tests.server_support import (
    LONG,
    PROMPTS,
    SHORT,
    WAIT,
    LiveServer,
    admin,
    assert_finished,
    background,
    client_fixture,  # noqa: F401 - a fixture, by name
    client_of,
    complete,
    greedy,
    is_idle,
    on_server,
    restored_fixture,  # noqa: F401 - a fixture, by name
    server_fixture,  # noqa: F401 - a fixture, by name
    stream,
    tiny_engines,
    until,
    until_idle,
)
from tests.test_pool import record_transitions

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample of a scrape; a counter not there yet counts as 0 (see the request_success test for that)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


# ==== 1. clients that go away ===========================================================================
NUM_STREAMS = 100
DISCONNECT_TOKENS = 24


async def test_a_third_of_100_streams_disconnecting_mid_stream_leaves_the_rest_whole_and_frees_every_block(
    server: LiveServer, client: httpx.AsyncClient
) -> None:
    """The streams that leave ask for LONG tokens: with 24, a loaded host let some run to their end before
    their client's third chunk was read, and those finished as "length" (32-33 aborts counted of 34)."""
    before = await scrape(client)
    leaving = [i % 3 == 0 for i in range(NUM_STREAMS)]
    bodies = [
        greedy([10 + i % 50, 20, 30 + i % 7], LONG if leave else DISCONNECT_TOKENS, logprobs=0)
        for i, leave in enumerate(leaving)
    ]
    got = await asyncio.gather(
        *(stream(client, b, leave_after=3 if leave else None) for b, leave in zip(bodies, leaving, strict=True))
    )
    stayed = [s for s, leave in zip(got, leaving, strict=True) if not leave]
    assert_finished(stayed, DISCONNECT_TOKENS)
    assert [s.tokens for s in stayed] == [DISCONNECT_TOKENS] * len(stayed)
    assert all(len(s.choices) == 3 and not s.done for s, leave in zip(got, leaving, strict=True) if leave)
    await until_idle(server)
    after = await scrape(client)
    finished = {
        reason: delta(before, after, "aioengine:request_success_total", model_name="tiny", finished_reason=reason)
        for reason in ("abort", "length")
    }
    assert finished == {"abort": sum(leaving), "length": NUM_STREAMS - sum(leaving)}


async def test_a_non_streamed_request_whose_client_times_out_is_aborted_in_the_engine(
    restored: LiveServer, client: httpx.AsyncClient
) -> None:
    # The request runs, then the engine is paused with its KV kept ("keep"): it cannot finish, so only the
    # client going away can end it.
    await until(restored, is_idle, "idle")
    request = background(
        client.post("/v1/completions", json=greedy([1, 2, 3], LONG), timeout=httpx.Timeout(WAIT, read=2.0))
    )
    await until(restored, lambda s: s.stats.requests_running == 1, "running")
    assert (await admin(client, "/pause", mode="keep")).status_code == 200
    with pytest.raises(httpx.ReadTimeout):
        await request
    gone = await until(restored, lambda s: s.held == 0 and s.stats.requests_held == 0, "released by its client")
    assert gone.stats.kv_blocks_free == gone.stats.kv_blocks_total, "the aborted request kept its KV blocks"
    assert (await admin(client, "/resume")).status_code == 200
    await until_idle(restored)


# ==== 2. two models under a budget that holds one ========================================================
MODELS = ("llama", "qwen2")


@pytest.fixture(scope="module")
def two_models(llama_ckpt: Path, qwen2_ckpt: Path) -> Iterator[LiveServer]:
    """llama and qwen2 behind one server; the budget, set once both footprints are measured, holds one."""
    engines = {**tiny_engines(llama_ckpt, "llama"), **tiny_engines(qwen2_ckpt, "qwen2")}
    with LiveServer(engines) as live:
        footprints = live.pool.stats().footprints
        small, large = sorted(footprints[name] for name in MODELS)
        assert small > 0

        async def set_budget() -> None:
            live.pool.budget_bytes = large + small // 2  # the larger fits, not both

        live.call(set_budget)
        yield live


async def awake_by_the_models_list(client: httpx.AsyncClient) -> list[str]:
    response = await client.get("/v1/models")
    assert response.status_code == 200, response.text
    return [card["id"] for card in response.json()["data"] if not card["sleeping"]]


async def test_interleaved_requests_to_two_models_give_each_models_own_outputs_with_one_awake_at_a_time(
    two_models: LiveServer,
) -> None:
    async def install() -> list[tuple[str, str, tuple[str, ...]]]:
        return record_transitions({name: two_models.pool.engine(name) for name in MODELS})

    log = two_models.call(install)
    async with client_of(two_models) as client:
        alone = {name: [(await complete(client, greedy(p, SHORT, name)))["choices"][0]["text"] for p in PROMPTS]
                 for name in MODELS}  # fmt: skip
        assert alone["llama"] != alone["qwen2"], "the models must tell apart"
        looks: list[list[str]] = []
        done = asyncio.Event()

        async def look() -> None:
            while not done.is_set():
                looks.append(await awake_by_the_models_list(client))

        looking = background(look())
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in MODELS] * 2
        try:
            answers = await asyncio.gather(*(complete(client, greedy(PROMPTS[i], SHORT, name)) for name, i in jobs))
        finally:
            done.set()
            await looking
    for (name, i), answer in zip(jobs, answers, strict=True):
        assert answer["model"] == name
        assert answer["choices"][0]["text"] == alone[name][i], (name, i)
    assert looks and all(len(awake) <= 1 for awake in looks), looks
    assert {name for event, name, _ in log if event == "woke"} == set(MODELS), log
    assert all(len(awake) <= 1 for _, _, awake in log), log


async def test_the_models_list_names_both_models_and_which_one_sleeps(two_models: LiveServer) -> None:
    async with client_of(two_models) as client:
        for name in MODELS:
            await complete(client, greedy(PROMPTS[0], 2, name))  # wakes it, putting the other to sleep
            response = await client.get("/v1/models")
            assert response.status_code == 200, response.text
            cards = {card["id"]: card for card in response.json()["data"]}
            assert sorted(cards) == sorted(MODELS)
            assert {n: card["sleeping"] for n, card in cards.items()} == {n: n != name for n in MODELS}
            assert all(card["object"] == "model" and card["max_model_len"] > 0 for card in cards.values())


# ==== 3. /metrics ========================================================================================
SERIES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_blocks_free", "kv_blocks_total",
          "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total", "num_swapped_out_total",
          "is_sleeping", "weights_version", "prompt_tokens_total", "generation_tokens_total",
          "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
          "e2e_request_latency_seconds_count")  # fmt: skip


async def test_metrics_parse_as_prometheus_text_with_every_series_of_the_model(client: httpx.AsyncClient) -> None:
    await complete(client, greedy(PROMPTS[0], 2))
    samples = await scrape(client)
    names = {name for name, labels in samples if ("model_name", "tiny") in labels}
    assert {f"aioengine:{series}" for series in SERIES} <= names, sorted(names)
    assert ("aioengine:pool_switches_total", frozenset()) in samples


async def test_request_success_has_a_series_for_every_finish_reason_from_the_start(client: httpx.AsyncClient) -> None:
    samples = await scrape(client)
    for reason in ("stop", "length", "abort"):  # metrics.py: "every model's series starts with [them], at 0"
        key = ("aioengine:request_success_total", frozenset({("model_name", "tiny"), ("finished_reason", reason)}))
        assert key in samples, f"no request_success_total series for {reason!r}"


async def test_token_and_request_counters_move_by_what_the_responses_reported(
    server: LiveServer, client: httpx.AsyncClient
) -> None:
    async def stop_token() -> int:  # the third token of PROMPTS[1]'s greedy output, on the weights now served
        out = await last_output(server.pool.generate("tiny", PROMPTS[1], SamplingParams(max_tokens=3, temperature=0)))
        return out.outputs[0].token_ids[2]

    stop = await on_server(server, stop_token)
    await until_idle(server)
    before = await scrape(client)
    answers = [await complete(client, greedy(p, n)) for p, n in zip(PROMPTS, (3, 5, 7), strict=True)]
    answers.append(await complete(client, greedy(PROMPTS[1], SHORT, stop_token_ids=[stop])))
    streamed = await stream(client, greedy(PROMPTS[2], 6))
    await until_idle(server)
    after = await scrape(client)
    usages = [a["usage"] for a in answers] + [streamed.usage]
    reasons = [a["choices"][0]["finish_reason"] for a in answers] + [streamed.finish_reason]
    assert reasons == ["length", "length", "length", "stop", "length"]
    tiny = {"model_name": "tiny"}
    assert delta(before, after, "aioengine:prompt_tokens_total", **tiny) == sum(u["prompt_tokens"] for u in usages)
    generated = delta(before, after, "aioengine:generation_tokens_total", **tiny)
    assert generated == sum(u["completion_tokens"] for u in usages)
    for reason in ("stop", "length", "abort"):
        moved = delta(before, after, "aioengine:request_success_total", finished_reason=reason, **tiny)
        assert moved == reasons.count(reason), reason
    assert delta(before, after, "aioengine:time_to_first_token_seconds_count", **tiny) == len(reasons)
    assert delta(before, after, "aioengine:e2e_request_latency_seconds_count", **tiny) == len(reasons)


async def test_is_sleeping_flips_with_sleep_and_wake_up(restored: LiveServer, client: httpx.AsyncClient) -> None:
    def sleeping(samples: Samples) -> float:
        return value(samples, "aioengine:is_sleeping", model_name="tiny")

    assert sleeping(await scrape(client)) == 0
    assert (await admin(client, "/sleep", level=1)).status_code == 200
    assert sleeping(await scrape(client)) == 1
    assert (await admin(client, "/wake_up")).status_code == 200
    assert sleeping(await scrape(client)) == 0


async def test_weights_version_moves_with_update_weights(
    restored: LiveServer, client: httpx.AsyncClient, ckpt_b: Path
) -> None:
    before = value(await scrape(client), "aioengine:weights_version", model_name="tiny")
    response = await admin(client, "/update_weights", path=str(ckpt_b))
    assert response.status_code == 200, response.text
    version = value(await scrape(client), "aioengine:weights_version", model_name="tiny")
    assert version == before + 1 == response.json()["weights_version"]
