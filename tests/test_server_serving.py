"""The HTTP server end to end: real sockets on 127.0.0.1, real engines behind them.

Clients that go away mid-request, several models under one budget, the admin endpoints while streams run,
``/metrics`` as requests go, and ``aioengine serve`` as a process (its start line, its shutdown modes). Every
wait is on the engine's state (its stats, a stream's events, ``/metrics``), never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aioengine import AsyncEngine, SamplingParams
from aioengine.engine.outputs import CompletionOutput
from aioengine.engine.stats import EngineStats
from tests.conftest import engine_config
from tests.helpers import last_output
from tests.server_support import LiveServer, tiny_engines
from tests.test_pool import record_transitions

T = TypeVar("T")

ADMIN_KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [42, 43, 44, 45, 46]]
SHORT = 8
"""Tokens of a request whose output is compared with a reference."""
STREAM = 48
"""Tokens of a stream that must finish while a control call runs (long enough for the call to land mid-stream)."""
LONG = 1500
"""Tokens of a stream that must be cut short: minutes of decoding on CPU, so finishing it would show."""
WAIT = 60.0
"""Seconds any wait on the server may take before its test fails."""
REPO = Path(__file__).resolve().parents[1]

Refs = dict[str, dict[int, list[CompletionOutput]]]
"""``refs[checkpoint][max_tokens][prompt index]``: a lone engine's greedy output, checkpoint "A" or "B"."""


def greedy(prompt: list[int], max_tokens: int, model: str = "tiny", **extra: Any) -> dict[str, Any]:
    """A completion body: greedy, EOS ignored, so it runs exactly ``max_tokens`` unless stopped."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


# ---- references ----------------------------------------------------------------------------------------
async def _reference(path: Path) -> dict[int, list[CompletionOutput]]:
    async with AsyncEngine(engine_config(path, cache={"num_blocks": 64})) as engine:
        refs = {}
        for n in (SHORT, STREAM):
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            outs = await asyncio.gather(*(last_output(engine.generate(p, params)) for p in PROMPTS))
            refs[n] = [out.outputs[0] for out in outs]
        return refs


@pytest.fixture(scope="module")
def refs(llama_ckpt: Path, ckpt_b: Path) -> Refs:
    """Checkpoint A (the servers' llama) and B (same shapes, other weights), each on an engine of its own."""
    refs = {"A": asyncio.run(_reference(llama_ckpt)), "B": asyncio.run(_reference(ckpt_b))}
    assert [o.text for o in refs["A"][SHORT]] != [o.text for o in refs["B"][SHORT]], "A and B must tell apart"
    return refs


# ---- servers and clients -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(llama_ckpt: Path) -> Iterator[LiveServer]:
    """One model, "tiny" (checkpoint A), with the admin endpoints; tests that change it put it back."""
    with LiveServer(tiny_engines(llama_ckpt, cache={"num_blocks": 256}), admin_key=ADMIN_KEY) as live:
        yield live


@contextlib.asynccontextmanager
async def client_of(live: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=live.url, timeout=WAIT, limits=limits) as client:
        yield client


_background: set[asyncio.Task[Any]] = set()
"""Requests a test runs in the background; the ``client`` fixture ends those a failed test left."""


def background(work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    task = asyncio.create_task(work)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


@pytest.fixture
async def client(server: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the module's server; requests a failed test left running are cancelled (their connections
    closed) before the client goes."""
    async with client_of(server) as client:
        yield client
        left = list(_background)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)


@pytest.fixture
def restored(server: LiveServer) -> Iterator[LiveServer]:
    """The module's server, put back afterwards: resumed, awake, on checkpoint A again if its weights changed."""
    version = server.stats().weights_version
    yield server
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=WAIT) as admin:
        for path in ("/resume", "/wake_up"):
            admin.post(path).raise_for_status()
        stats = server.stats()
        if stats.weights_version != version or not stats.weights_valid:
            admin.post("/reload_weights").raise_for_status()
    server.call(lambda: until_idle(server))


# ---- reading the server's state ------------------------------------------------------------------------
async def on_server(live: LiveServer, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Runs ``make()`` on the server's loop without blocking this one (whose clients the server is serving)."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make(), live.loop))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An engine's stats and how many HTTP requests hold it (``EnginePool.use``), read together."""

    stats: EngineStats
    held: int


def snapshot(live: LiveServer, model: str) -> Snapshot:
    """On the server's loop only."""
    return Snapshot(live.pool.engine(model).stats(), live.pool.stats().active[model])


def is_idle(s: Snapshot) -> bool:
    stats = s.stats
    return (
        stats.kv_blocks_free == stats.kv_blocks_total > 0
        and stats.requests_running == stats.requests_waiting == stats.requests_held == 0
        and s.held == 0
    )


async def until(
    live: LiveServer, condition: Callable[[Snapshot], bool], what: str, model: str = "tiny", timeout: float = WAIT
) -> Snapshot:
    """Polls the engine (on the server's loop when called there, else from this loop) until ``condition``."""
    deadline = time.monotonic() + timeout
    here = asyncio.get_running_loop() is live.loop
    while True:
        if here:
            now = snapshot(live, model)
        else:

            async def read() -> Snapshot:
                return snapshot(live, model)

            now = await on_server(live, read)
        if condition(now):
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what} after {timeout}s: {now}")
        await asyncio.sleep(0.005)


async def until_idle(live: LiveServer, model: str = "tiny") -> Snapshot:
    return await until(live, is_idle, "idle: every KV block free, nothing running, waiting or held", model)


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


# ---- requests ------------------------------------------------------------------------------------------
async def admin(client: httpx.AsyncClient, endpoint: str, **args: Any) -> httpx.Response:
    return await client.post(endpoint, json=args, headers=ADMIN)


async def complete(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@dataclass(slots=True)
class Streamed:
    """What a streaming client read: every chunk, whether ``data: [DONE]`` came, an error event if one did."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    error: dict[str, Any] | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by the first chunk with text: the request is running in the engine."""

    @property
    def choices(self) -> list[dict[str, Any]]:
        return [c["choices"][0] for c in self.chunks if c["choices"]]

    @property
    def text(self) -> str:
        return "".join(c["text"] for c in self.choices)

    @property
    def tokens(self) -> int:
        """Tokens streamed, counted from the chunks' logprobs (a request with ``logprobs``; a chunk may bring
        several tokens when the client reads slower than the engine decodes)."""
        return sum(len(c["logprobs"]["tokens"]) for c in self.choices)

    @property
    def finish_reason(self) -> str | None:
        return self.choices[-1]["finish_reason"] if self.choices else None

    @property
    def usage(self) -> dict[str, int] | None:
        return self.chunks[-1].get("usage") if self.chunks else None

    @property
    def fingerprints(self) -> list[str]:
        """The system_fingerprint of each chunk with a choice, in order (duplicates folded)."""
        return list(dict.fromkeys(c["system_fingerprint"] for c in self.chunks if c["choices"]))

    def take(self, line: str) -> bool:
        """Reads one line of the event stream; True if it was a chunk with text (a token)."""
        if not line:
            return False
        assert line.startswith("data: "), line
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            self.done = True
            return False
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = chunk
            return False
        self.chunks.append(chunk)
        if chunk["choices"] and chunk["choices"][0]["text"]:
            self.started.set()
            return True
        return False


def streaming(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


async def stream(
    client: httpx.AsyncClient, body: dict[str, Any], into: Streamed | None = None, leave_after: int | None = None
) -> Streamed:
    """Streams a completion; with ``leave_after`` the client closes the connection after that many chunks."""
    got = into if into is not None else Streamed()
    async with client.stream("POST", "/v1/completions", json=streaming(body)) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            got.take(line)
            if leave_after is not None and len(got.choices) >= leave_after:
                return got  # leaving the block closes the response: the server sees the client go
    return got


class Streams:
    """Streams run in background tasks; ``started`` returns once every one is generating."""

    def __init__(self, client: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> None:
        self.got = [Streamed() for _ in bodies]
        self.tasks = [background(stream(client, b, s)) for b, s in zip(bodies, self.got, strict=True)]

    async def started(self) -> None:
        async with asyncio.timeout(WAIT):
            await asyncio.gather(*(s.started.wait() for s in self.got))

    async def results(self) -> list[Streamed]:
        async with asyncio.timeout(WAIT):
            return await asyncio.gather(*self.tasks)


def running(client: httpx.AsyncClient, max_tokens: int) -> Streams:
    return Streams(client, [greedy(p, max_tokens) for p in PROMPTS])


async def outputs(client: httpx.AsyncClient) -> tuple[list[str], set[str]]:
    """Fresh greedy outputs of PROMPTS (SHORT tokens), one at a time, and the fingerprints they came with."""
    answers = [await complete(client, greedy(p, SHORT)) for p in PROMPTS]
    return [a["choices"][0]["text"] for a in answers], {a["system_fingerprint"] for a in answers}


def texts(refs: Refs, checkpoint: str, max_tokens: int = SHORT) -> list[str]:
    return [o.text for o in refs[checkpoint][max_tokens]]


def assert_finished(got: list[Streamed], max_tokens: int) -> None:
    """Every stream ran to its last token and ended with the usage chunk and ``[DONE]``."""
    for i, s in enumerate(got):
        assert s.error is None, (i, s.error)
        assert (s.finish_reason, s.done) == ("length", True), (i, s.finish_reason, s.done)
        assert s.usage is not None and s.usage["completion_tokens"] == max_tokens, (i, s.usage)


def assert_aborted(got: list[Streamed], max_tokens: int = LONG) -> None:
    """Every stream ended early with finish_reason "abort", then ``[DONE]``."""
    for i, s in enumerate(got):
        assert s.error is None, (i, s.error)
        assert (s.finish_reason, s.done) == ("abort", True), (i, s.finish_reason, s.done)
        assert s.usage is not None and s.usage["completion_tokens"] < max_tokens, (i, s.usage)


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


# ==== 3. admin control while streams run ================================================================
async def is_sleeping(client: httpx.AsyncClient) -> bool:
    response = await client.get("/is_sleeping", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()["is_sleeping"]


async def test_sleep_level_1_mode_wait_finishes_the_running_streams_then_sleeps_until_wake_up(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs
) -> None:
    streams = running(client, STREAM)
    await streams.started()
    response = await admin(client, "/sleep", level=1, mode="wait")
    assert response.status_code == 200, response.text
    got = await streams.results()
    assert_finished(got, STREAM)
    assert [s.text for s in got] == texts(refs, "A", STREAM)  # on the weights they started with, to the end
    assert await is_sleeping(client)
    assert (await admin(client, "/wake_up")).status_code == 200
    assert not await is_sleeping(client)
    assert (await outputs(client))[0] == texts(refs, "A")


async def test_sleep_level_2_mode_abort_ends_the_running_streams_and_reload_after_wake_up_serves_again(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs
) -> None:
    streams = running(client, LONG)
    await streams.started()
    response = await admin(client, "/sleep", level=2, mode="abort")
    assert response.status_code == 200, response.text
    assert response.json()["aborted"] == len(PROMPTS)
    assert_aborted(await streams.results())
    assert await is_sleeping(client)
    assert (await admin(client, "/wake_up")).status_code == 200
    assert not await is_sleeping(client)
    # Level 2 discarded the weights and /wake_up leaves them so (a trainer pushes new ones next); reload them.
    assert not restored.stats().weights_valid
    assert (await admin(client, "/reload_weights")).status_code == 200
    assert (await outputs(client))[0] == texts(refs, "A")


async def test_pause_mode_abort_ends_the_running_streams_and_holds_new_requests_until_resume(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs
) -> None:
    streams = running(client, LONG)
    await streams.started()
    response = await admin(client, "/pause", mode="abort")
    assert response.status_code == 200, response.text
    assert_aborted(await streams.results())
    later = background(complete(client, greedy(PROMPTS[0], SHORT)))
    await until(restored, lambda s: s.stats.paused and s.stats.requests_waiting == 1, "a request queued, paused")
    assert not later.done()
    assert (await admin(client, "/resume")).status_code == 200
    assert (await later)["choices"][0]["text"] == texts(refs, "A")[0]


async def test_pause_mode_wait_lets_the_running_streams_finish_first(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs
) -> None:
    streams = running(client, STREAM)
    await streams.started()
    response = await admin(client, "/pause", mode="wait")
    assert response.status_code == 200, response.text
    assert restored.stats().requests_running == 0  # the pause took hold once they had finished
    got = await streams.results()
    assert_finished(got, STREAM)
    assert [s.text for s in got] == texts(refs, "A", STREAM)
    assert restored.stats().paused
    assert (await admin(client, "/resume")).status_code == 200
    assert not restored.stats().paused


async def test_pause_mode_keep_freezes_the_running_streams_which_go_on_unchanged_after_resume(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs
) -> None:
    streams = running(client, STREAM)
    await streams.started()
    response = await admin(client, "/pause", mode="keep")
    assert response.status_code == 200, response.text
    frozen = restored.stats()
    assert frozen.paused and frozen.requests_running == len(PROMPTS), frozen  # held between two steps, with KV
    assert not any(task.done() for task in streams.tasks)
    assert (await admin(client, "/resume")).status_code == 200
    got = await streams.results()
    assert_finished(got, STREAM)
    assert [s.text for s in got] == texts(refs, "A", STREAM)


async def update_while_streaming(
    client: httpx.AsyncClient, path: Path, mode: str, max_tokens: int
) -> tuple[dict[str, Any], list[Streamed], str]:
    """Streams PROMPTS, updates the weights from ``path`` in ``mode`` while they run; returns the update's
    report, the streams and the fingerprint the server answered with just before."""
    before = (await complete(client, greedy(PROMPTS[0], 1)))["system_fingerprint"]
    streams = running(client, max_tokens)
    await streams.started()
    response = await admin(client, "/update_weights", path=str(path), mode=mode)
    assert response.status_code == 200, response.text
    return response.json(), await streams.results(), before


def assert_new_fingerprint(prints: set[str], before: str, version: int) -> None:
    """Fresh answers all carry one fingerprint: not the one from before the update, and naming its version."""
    assert len(prints) == 1 and before not in prints and next(iter(prints)).endswith(f"-w{version}"), (prints, before)


async def test_update_weights_mode_pause_swaps_under_the_running_streams_and_new_requests_get_the_new_weights(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs, ckpt_b: Path
) -> None:
    report, got, before = await update_while_streaming(client, ckpt_b, "pause", STREAM)
    assert_finished(got, STREAM)
    version = report["weights_version"]
    for s in got:  # each stream's first tokens came from the old weights, its last from the new
        assert len(s.fingerprints) == 2 and s.fingerprints[0] == before, s.fingerprints
        assert s.fingerprints[1].endswith(f"-w{version}"), s.fingerprints
    after, prints = await outputs(client)
    assert after == texts(refs, "B")
    assert_new_fingerprint(prints, before, version)


async def test_update_weights_mode_drain_finishes_the_running_streams_on_the_old_weights_first(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs, ckpt_b: Path
) -> None:
    report, got, before = await update_while_streaming(client, ckpt_b, "drain", STREAM)
    assert_finished(got, STREAM)
    assert [s.text for s in got] == texts(refs, "A", STREAM)
    assert all(s.fingerprints == [before] for s in got)
    after, prints = await outputs(client)
    assert after == texts(refs, "B")
    assert_new_fingerprint(prints, before, report["weights_version"])


async def test_update_weights_mode_abort_ends_the_running_streams(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs, ckpt_b: Path
) -> None:
    report, got, before = await update_while_streaming(client, ckpt_b, "abort", LONG)
    assert report["aborted"] == len(PROMPTS)
    assert_aborted(got)
    assert all(s.fingerprints == [before] for s in got)
    after, prints = await outputs(client)
    assert after == texts(refs, "B")
    assert_new_fingerprint(prints, before, report["weights_version"])


async def test_update_weights_mode_recompute_finishes_the_running_streams_on_the_new_weights(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs, ckpt_b: Path
) -> None:
    report, got, before = await update_while_streaming(client, ckpt_b, "recompute", STREAM)
    assert report["preempted"] == len(PROMPTS)
    assert_finished(got, STREAM)
    version = report["weights_version"]
    for s in got:  # begun on the old weights, ended on the new (their KV recomputed under them)
        assert s.fingerprints[0] == before and s.fingerprints[-1].endswith(f"-w{version}"), s.fingerprints
    after, prints = await outputs(client)
    assert after == texts(refs, "B")
    assert_new_fingerprint(prints, before, version)


async def test_reload_weights_brings_back_the_checkpoint_the_server_started_from(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs, ckpt_b: Path
) -> None:
    response = await admin(client, "/update_weights", path=str(ckpt_b))
    assert response.status_code == 200, response.text
    on_b, (before,) = await outputs(client)
    assert on_b == texts(refs, "B")
    streams = running(client, STREAM)
    await streams.started()
    response = await admin(client, "/reload_weights", mode="drain")
    assert response.status_code == 200, response.text
    got = await streams.results()
    assert_finished(got, STREAM)
    assert [s.text for s in got] == texts(refs, "B", STREAM)  # drained on B
    after, prints = await outputs(client)
    assert after == texts(refs, "A")
    assert_new_fingerprint(prints, before, response.json()["weights_version"])


async def test_reset_prefix_cache_is_refused_while_requests_run_unless_forced(
    restored: LiveServer, client: httpx.AsyncClient
) -> None:
    streams = running(client, LONG)
    await streams.started()
    refused = await admin(client, "/reset_prefix_cache")
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "engine_state" and "force" in refused.json()["error"]["message"]
    forced = await admin(client, "/reset_prefix_cache", force=True)
    assert forced.status_code == 200, forced.text
    assert isinstance(forced.json()["cached_blocks"], int)
    assert (await admin(client, "/pause", mode="abort")).status_code == 200
    assert_aborted(await streams.results())
    assert (await admin(client, "/resume")).status_code == 200
    await until_idle(restored)
    idle = await admin(client, "/reset_prefix_cache")
    assert idle.status_code == 200, idle.text
    assert restored.stats().prefix_cache_blocks == 0


async def test_an_update_from_a_missing_path_is_a_client_error_that_changes_nothing(
    restored: LiveServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    before = await outputs(client)
    version = restored.stats().weights_version
    response = await admin(client, "/update_weights", path=str(tmp_path / "missing"), mode="pause")
    assert await outputs(client) == before  # the same texts, under the same fingerprint
    assert restored.stats().weights_version == version
    assert "missing" in response.json()["error"]["message"]
    assert 400 <= response.status_code < 500, (response.status_code, response.text)


# ==== 4. /metrics ========================================================================================
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


# ==== 5. `aioengine serve` as a process =================================================================
DRAINED = 256
"""Tokens of the stream a "finish" shutdown lets complete: seconds of decoding, so the signal lands mid-stream."""
START_LINE = re.compile(r"aioengine: serving (?P<models>.+) at (?P<url>http://\S+)/v1 \(admin endpoints")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory, llama_ckpt: Path) -> Path:
    path = tmp_path_factory.mktemp("serve") / "serve.toml"
    path.write_text(
        "[server]\nport = 0\n\n"
        '[device]\ndevice = "cpu"\n\n[model]\ndtype = "float32"\n\n[cache]\nnum_blocks = 128\n\n'
        f"[models.tiny.model]\npath = {json.dumps(str(llama_ckpt))}\n"
    )
    return path


def serve_command(config: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "aioengine.cli", "serve", "--config", str(config), *flags]


class Served:
    """``aioengine serve`` in a subprocess; its stderr is read line by line in a thread (so it never blocks)."""

    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(
            command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def start_line(self, timeout: float = 120.0) -> re.Match[str]:
        """The line saying the server takes requests (fails if the process ends or stays silent first)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            if match := START_LINE.match(line):
                return match
        raise AssertionError(f"no start line (exit status {self.process.poll()}); stderr:\n{''.join(self.stderr)}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


@contextlib.contextmanager
def served(config: Path, *flags: str) -> Iterator[tuple[Served, str]]:
    """The process and the URL of its start line; killed at the end whatever happened."""
    process = Served(serve_command(config, *flags))
    try:
        match = process.start_line()
        assert match["models"] == "tiny", match.group(0)
        yield process, match["url"]
    finally:
        process.kill()


def stream_then_terminate(process: Served, url: str, max_tokens: int) -> tuple[Streamed, float]:
    """Streams a completion, sends SIGTERM once it has a token, reads it to its end; returns it and the seconds
    from the signal to that end."""
    got, signalled = Streamed(), 0.0
    body = streaming(greedy(PROMPTS[1], max_tokens))
    with httpx.Client(base_url=url, timeout=WAIT) as client, client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if got.take(line) and not signalled:
                process.process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
    assert signalled, "the stream never brought a token"
    return got, time.monotonic() - signalled


@pytest.fixture(scope="module")
def finishing(config_file: Path) -> Iterator[tuple[Served, str]]:
    """One process (``--shutdown finish``, no host given) for the start-line test, then the SIGTERM test that
    ends it: a start costs seconds of CPU kernels and engine set-up."""
    with served(config_file, "--shutdown", "finish") as process_and_url:
        yield process_and_url


def test_serve_starts_on_127_0_0_1_by_default_names_its_models_and_answers_at_its_url(
    finishing: tuple[Served, str],
) -> None:
    _, url = finishing
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
    with httpx.Client(base_url=url, timeout=WAIT) as client:
        models = client.get("/v1/models")
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["tiny"]
        answer = client.post("/v1/completions", json=greedy(PROMPTS[0], SHORT))
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == SHORT


def test_sigterm_with_shutdown_finish_lets_the_running_stream_complete_then_exits_0(
    finishing: tuple[Served, str],
) -> None:
    process, url = finishing
    got, _ = stream_then_terminate(process, url, DRAINED)
    assert_finished([got], DRAINED)
    assert process.process.wait(WAIT) == 0, "".join(process.stderr)


def test_sigterm_with_shutdown_abort_ends_the_running_stream_with_abort_and_exits_0(config_file: Path) -> None:
    with served(config_file, "--shutdown", "abort") as (process, url):
        got, seconds = stream_then_terminate(process, url, LONG)
        assert_aborted([got])
        assert seconds < WAIT / 2, f"the aborted stream took {seconds:.1f}s to end"
        assert process.process.wait(WAIT) == 0, "".join(process.stderr)


def test_serve_on_a_port_in_use_fails_with_a_clear_message_and_a_nonzero_status(config_file: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            serve_command(config_file, "--port", str(port)), cwd=REPO, capture_output=True, text=True, timeout=120
        )
    assert result.returncode != 0, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "in use" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
