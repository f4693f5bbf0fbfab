"""ServerMetrics: the Prometheus series of GET /metrics, read back from the rendered text.

Real engines in a real pool, no HTTP: each test drives requests the way the server does (a tracker per
request, ``tokens`` per streamed output, ``finish`` at the end) and checks the numbers against what the
streams and the engines themselves report.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aioengine import AsyncEngine, EnginePool, RequestOutput, SamplingParams
from aioengine.server.metrics import ServerMetrics
from tests.conftest import engine_config
from tests.helpers import TIMEOUT, wait_until, wait_until_idle

PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [42, 43, 44, 45, 46]]
MAX_TOKENS = [4, 7, 9]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture
async def pool(llama_ckpt: Path) -> AsyncIterator[EnginePool]:
    """One engine, "llama", asleep after the pool's start (as every pooled engine is)."""
    async with EnginePool({"llama": engine_config(llama_ckpt, cache={"num_blocks": 64})}) as pool:
        yield pool


@pytest.fixture
def unstarted_pool(llama_ckpt: Path) -> EnginePool:
    """A pool never started: enough for what only the trackers observe, at no cost."""
    return EnginePool({"llama": engine_config(llama_ckpt, cache={"num_blocks": 64})})


Scrape = Callable[..., float]
"""A rendered scrape: ``value(name, **labels)`` -> the sample's value."""


def scrape(metrics: ServerMetrics) -> Scrape:
    """Renders ``metrics`` once; the result gives a sample's value: ``value(name, model_name="llama")``."""
    body, content_type = metrics.render()
    assert content_type == prometheus_client.CONTENT_TYPE_LATEST
    values = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }

    def value(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in values, f"no sample {name}{labels} in:\n{body.decode()}"
        return values[key]

    return value


@dataclass(frozen=True, slots=True)
class Served:
    """What the client of one tracked request got: the final output, and how many tokens the first brought."""

    final: RequestOutput
    first_tokens: int

    @property
    def generated(self) -> int:
        return sum(len(o.token_ids) for o in self.final.outputs)


Run = tuple[Scrape, Scrape, list[Served]]
"""The scrape before the requests, the scrape after, and what their clients got."""


async def serve(
    pool: EnginePool,
    metrics: ServerMetrics,
    model: str,
    prompt: list[int],
    params: SamplingParams,
    request_id: str | None = None,
) -> Served:
    """One request as the server runs it: tracked from acceptance to its final output."""
    tracker = metrics.track(model)
    final, first_tokens = None, 0
    async with asyncio.timeout(TIMEOUT):
        async for out in pool.generate(model, prompt, params, request_id):
            n = sum(len(o.delta_token_ids) for o in out.outputs)
            tracker.tokens(n)
            first_tokens = first_tokens or n
            final = out
    assert final is not None and final.finish_reason is not None
    served = Served(final, first_tokens)
    tracker.finish(len(final.prompt_token_ids), served.generated, final.finish_reason)
    return served


async def serve_all(pool: EnginePool, metrics: ServerMetrics, model: str = "llama") -> list[Served]:
    """PROMPTS, concurrently, with MAX_TOKENS."""
    return await asyncio.gather(
        *(serve(pool, metrics, model, p, greedy(n)) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True))
    )


def engine_of(pool: EnginePool, model: str = "llama") -> AsyncEngine:
    return pool.tenants[model].engine


@pytest.fixture(scope="module")
def served_run(llama_ckpt: Path) -> Run:
    """PROMPTS served once on a fresh pool, shared by the tests of what the trackers observed."""

    async def run() -> Run:
        async with EnginePool({"llama": engine_config(llama_ckpt, cache={"num_blocks": 64})}) as pool:
            metrics = ServerMetrics(pool)
            before = scrape(metrics)
            served = await serve_all(pool, metrics)
            return before, scrape(metrics), served

    return asyncio.run(run())


# ---- observed per request -------------------------------------------------------------------------------
def test_token_counters_sum_the_tokens_of_the_finished_requests(served_run: Run) -> None:
    before, value, served = served_run
    assert before("aioengine:prompt_tokens_total", model_name="llama") == 0
    assert before("aioengine:generation_tokens_total", model_name="llama") == 0
    assert value("aioengine:prompt_tokens_total", model_name="llama") == sum(len(p) for p in PROMPTS)
    assert value("aioengine:generation_tokens_total", model_name="llama") == sum(s.generated for s in served)
    assert sum(s.generated for s in served) == sum(MAX_TOKENS)


def test_request_success_counts_each_request_under_its_finish_reason(
    served_run: Run,
) -> None:
    before, value, _ = served_run
    for reason in ("stop", "length", "abort"):  # every reason's series is there from the start
        assert before("aioengine:request_success_total", model_name="llama", finished_reason=reason) == 0
    assert value("aioengine:request_success_total", model_name="llama", finished_reason="length") == len(PROMPTS)
    assert value("aioengine:request_success_total", model_name="llama", finished_reason="stop") == 0
    assert value("aioengine:request_success_total", model_name="llama", finished_reason="abort") == 0


def test_latency_histograms_observe_one_ttft_and_e2e_per_request_and_one_itl_per_later_token(
    served_run: Run,
) -> None:
    _, value, served = served_run
    ttft_count = value("aioengine:time_to_first_token_seconds_count", model_name="llama")
    assert ttft_count == len(PROMPTS)
    assert value("aioengine:e2e_request_latency_seconds_count", model_name="llama") == len(PROMPTS)
    later_tokens = sum(s.generated - s.first_tokens for s in served)
    assert later_tokens > 0
    assert value("aioengine:inter_token_latency_seconds_count", model_name="llama") == later_tokens
    ttft_sum = value("aioengine:time_to_first_token_seconds_sum", model_name="llama")
    assert 0 < ttft_sum < value("aioengine:e2e_request_latency_seconds_sum", model_name="llama")
    # vLLM's buckets: every observation lands in the last one.
    assert value("aioengine:time_to_first_token_seconds_bucket", model_name="llama", le="2560.0") == ttft_count
    assert value("aioengine:inter_token_latency_seconds_bucket", model_name="llama", le="80.0") == later_tokens
    assert value("aioengine:e2e_request_latency_seconds_bucket", model_name="llama", le="7680.0") == len(PROMPTS)


def test_finishing_a_request_twice_counts_it_once(unstarted_pool: EnginePool) -> None:
    metrics = ServerMetrics(unstarted_pool)
    tracker = metrics.track("llama")
    tracker.tokens(1)
    tracker.finish(3, 1, "stop")
    tracker.finish(3, 1, "abort")  # e.g. the server's cleanup after the normal end
    tracker.tokens(1)  # too late: the request is over
    value = scrape(metrics)
    assert value("aioengine:request_success_total", model_name="llama", finished_reason="stop") == 1
    assert value("aioengine:request_success_total", model_name="llama", finished_reason="abort") == 0
    assert value("aioengine:prompt_tokens_total", model_name="llama") == 3
    assert value("aioengine:generation_tokens_total", model_name="llama") == 1
    assert value("aioengine:e2e_request_latency_seconds_count", model_name="llama") == 1
    assert value("aioengine:inter_token_latency_seconds_count", model_name="llama") == 0


def test_inter_token_latency_shares_an_outputs_time_among_its_tokens(unstarted_pool: EnginePool) -> None:
    metrics = ServerMetrics(unstarted_pool)
    tracker = metrics.track("llama")
    tracker.tokens(1)
    tracker.tokens(4)  # one output with four new tokens: four observations
    tracker.tokens(0)  # an output without new tokens observes nothing
    value = scrape(metrics)
    assert value("aioengine:time_to_first_token_seconds_count", model_name="llama") == 1
    assert value("aioengine:inter_token_latency_seconds_count", model_name="llama") == 4


def test_two_server_metrics_keep_their_own_series(unstarted_pool: EnginePool) -> None:
    first, second = ServerMetrics(unstarted_pool), ServerMetrics(unstarted_pool)  # one shared registry refuses this
    first.track("llama").finish(3, 2, "length")
    assert scrape(first)("aioengine:request_success_total", model_name="llama", finished_reason="length") == 1
    assert scrape(second)("aioengine:request_success_total", model_name="llama", finished_reason="length") == 0
    default = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "aioengine:" not in default


async def test_each_model_counts_only_its_own_requests(llama_ckpt: Path) -> None:
    engines = {name: engine_config(llama_ckpt, cache={"num_blocks": 64}) for name in ("a", "b")}
    async with EnginePool(engines) as pool:
        metrics = ServerMetrics(pool)
        served = await serve_all(pool, metrics, "a")
        value = scrape(metrics)
    assert value("aioengine:generation_tokens_total", model_name="a") == sum(s.generated for s in served)
    assert value("aioengine:generation_tokens_total", model_name="b") == 0
    assert value("aioengine:time_to_first_token_seconds_count", model_name="b") == 0
    assert value("aioengine:is_sleeping", model_name="a") == 0
    assert value("aioengine:is_sleeping", model_name="b") == 1


# ---- read from the engines at scrape time ---------------------------------------------------------------
async def test_a_running_request_shows_in_the_queue_and_kv_gauges_until_it_ends(pool: EnginePool) -> None:
    metrics = ServerMetrics(pool)
    engine = engine_of(pool)
    long = asyncio.create_task(serve(pool, metrics, "llama", PROMPTS[1], greedy(900), request_id="long"))
    running: list[Scrape] = []

    def scraped_running() -> bool:
        running[:] = [scrape(metrics)]
        return running[0]("aioengine:num_requests_running", model_name="llama") >= 1

    await wait_until(scraped_running, "running by the metrics", state=engine.stats)
    value = running[0]
    assert value("aioengine:kv_cache_usage_perc", model_name="llama") > 0
    free, total = (value(f"aioengine:kv_blocks_{kind}", model_name="llama") for kind in ("free", "total"))
    assert free < total
    assert await engine.abort("long")
    served = await long
    assert served.final.finish_reason == "abort"
    stats = await wait_until_idle(engine)
    value = scrape(metrics)
    assert value("aioengine:num_requests_running", model_name="llama") == 0
    assert value("aioengine:num_requests_waiting", model_name="llama") == 0
    assert value("aioengine:kv_cache_usage_perc", model_name="llama") == 0
    assert value("aioengine:kv_blocks_free", model_name="llama") == stats.kv_blocks_total
    assert value("aioengine:kv_blocks_total", model_name="llama") == stats.kv_blocks_total > 0
    assert value("aioengine:request_success_total", model_name="llama", finished_reason="abort") == 1


async def test_is_sleeping_follows_sleep_and_wake_up_and_pool_switches_count_the_wakes(pool: EnginePool) -> None:
    metrics = ServerMetrics(pool)
    engine = engine_of(pool)
    value = scrape(metrics)
    assert value("aioengine:is_sleeping", model_name="llama") == 1  # the pool's start put it to sleep
    assert value("aioengine:pool_switches_total") == 0
    await serve(pool, metrics, "llama", PROMPTS[0], greedy(2))  # the pool wakes it
    value = scrape(metrics)
    assert value("aioengine:is_sleeping", model_name="llama") == 0
    assert value("aioengine:pool_switches_total") == 1
    await engine.sleep(1)
    value = scrape(metrics)
    assert value("aioengine:is_sleeping", model_name="llama") == 1
    assert value("aioengine:kv_cache_usage_perc", model_name="llama") == 0
    await engine.wake_up()
    assert scrape(metrics)("aioengine:is_sleeping", model_name="llama") == 0


async def test_weights_version_follows_weight_writes(pool: EnginePool) -> None:
    metrics = ServerMetrics(pool)
    engine = engine_of(pool)
    assert scrape(metrics)("aioengine:weights_version", model_name="llama") == 0
    await engine.wake_up()
    await engine.reload_weights()
    assert engine.weights_version == 1
    assert scrape(metrics)("aioengine:weights_version", model_name="llama") == 1


async def test_prefix_cache_counters_count_the_prompt_tokens_looked_up_and_found(pool: EnginePool) -> None:
    metrics = ServerMetrics(pool)
    prompt = list(range(10, 50))  # two full blocks of 16, then 8 tokens
    for _ in range(2):
        await serve(pool, metrics, "llama", prompt, greedy(2))
    value = scrape(metrics)
    assert value("aioengine:prefix_cache_queries_total", model_name="llama") == 2 * len(prompt)
    assert value("aioengine:prefix_cache_hits_total", model_name="llama") == 32  # the second found both blocks
    assert value("aioengine:num_preemptions_total", model_name="llama") == 0
    assert value("aioengine:num_swapped_out_total", model_name="llama") == 0


async def test_revoked_steps_count_the_queued_steps_rpcs_took_back(pool: EnginePool) -> None:
    metrics = ServerMetrics(pool)
    engine = engine_of(pool)
    await engine.wake_up()
    assert scrape(metrics)("aioengine:num_revoked_steps_total", model_name="llama") == 0
    streams = asyncio.gather(*(serve(pool, metrics, "llama", p, greedy(200)) for p in PROMPTS))
    await wait_until(lambda: engine.stats().requests_running == len(PROMPTS), "every request running")
    entered, release = threading.Event(), threading.Event()

    def hold(worker: object) -> None:
        entered.set()
        release.wait(TIMEOUT)

    # The worker is held by the first RPC, so the steps the loop submits meanwhile wait on its thread; the
    # second RPC then takes back the one queued behind the other (a worker started neither).
    held = asyncio.ensure_future(engine.collective_rpc(hold))
    await wait_until(entered.is_set, "the worker held")
    inflight = engine.core._inflight
    await wait_until(lambda: len(inflight) == 2 and not any(f.done() for _, f in inflight), "two steps queued")
    second = asyncio.ensure_future(engine.collective_rpc(lambda worker: None))
    await asyncio.sleep(0)  # the call takes the queued step back and queues itself before its first await
    release.set()
    await asyncio.gather(held, second)
    await streams
    revoked = engine.stats().num_revoked_steps
    assert revoked >= 1  # the second call's, at least (the first may have taken one back too)
    assert scrape(metrics)("aioengine:num_revoked_steps_total", model_name="llama") == revoked


def test_engines_not_started_render_as_sleeping_and_empty(unstarted_pool: EnginePool) -> None:
    value = scrape(ServerMetrics(unstarted_pool))
    assert value("aioengine:is_sleeping", model_name="llama") == 1
    assert value("aioengine:kv_cache_usage_perc", model_name="llama") == 0
    assert value("aioengine:kv_blocks_total", model_name="llama") == 0
    assert value("aioengine:num_requests_running", model_name="llama") == 0
    assert value("aioengine:pool_switches_total") == 0
