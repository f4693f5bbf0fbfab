"""Sleep with requests in flight: what each mode (keep / abort / wait) does to them, requests that
arrive meanwhile, and a sleep that fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from tests.helpers import TIMEOUT, wait_until, wait_until_idle
from tests.sleep_support import PROMPTS, assert_queued_without_a_step, final, greedy, outputs_arrived, token_ids


@pytest.fixture
async def engine(llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]) -> AsyncIterator[AsyncEngine]:
    async with make_engine(llama_ckpt) as engine:
        yield engine


# ---- requests in flight: keep / abort / wait -------------------------------------------------------------
KEEP_PROMPTS = [f"request {i}: the weather today" for i in range(20)]


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 20,
        [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(20)],
    ],
    ids=["greedy", "seeded"],
)
async def test_keep_mode_requests_finish_with_the_tokens_of_an_uninterrupted_run(
    engine: AsyncEngine, params: list[SamplingParams]
) -> None:
    uninterrupted = await token_ids(engine, KEEP_PROMPTS, params)
    sink: list[RequestOutput] = []
    tasks = [asyncio.create_task(final(engine, p, sp, sink)) for p, sp in zip(KEEP_PROMPTS, params, strict=True)]
    await outputs_arrived(sink, 5)  # every request is mid-generation
    report = await engine.sleep(level=1, mode="keep")
    assert report.preempted > 0
    assert not any(task.done() for task in tasks)
    before_sleep = {o.request_id: list(o.token_ids) for o in sink}  # the last output of each before the sleep
    await engine.wake_up()
    outs = await asyncio.gather(*tasks)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in outs)
    if params[0].temperature == 0:
        assert [list(o.token_ids) for o in outs] == uninterrupted
        return
    # Seeded: recompute runs each context through the prefill path, whose float32 rounding differs from
    # the decode steps' in the last bits; over a random-init model's near-uniform distributions such a
    # difference flips a draw now and then, and the sequence goes its own way from there. Every token
    # streamed before the sleep is the uninterrupted run's, and most requests match it to the end (a seed
    # lost in the preemption would make every request diverge).
    for out, want in zip(outs, uninterrupted, strict=True):
        streamed = before_sleep.get(out.request_id, [])
        assert list(out.token_ids)[: len(streamed)] == streamed == want[: len(streamed)]
    same = sum(list(o.token_ids) == want for o, want in zip(outs, uninterrupted, strict=True))
    assert same >= 0.75 * len(outs), f"only {same} of {len(outs)} seeded requests match the uninterrupted run"


async def test_abort_mode_ends_requests_in_flight_with_finish_reason_abort(engine: AsyncEngine) -> None:
    expected = await token_ids(engine, PROMPTS, greedy())
    sink: list[RequestOutput] = []
    tasks = [asyncio.create_task(final(engine, p, greedy(400), sink)) for p in PROMPTS]
    await outputs_arrived(sink)
    report = await engine.sleep(level=1, mode="abort")
    outs = await asyncio.gather(*tasks)
    assert report.aborted == len(PROMPTS)
    assert [o.finish_reason for o in outs] == ["abort"] * len(PROMPTS)
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    await engine.wake_up()
    assert await token_ids(engine, PROMPTS, greedy()) == expected


async def test_wait_mode_finishes_requests_in_flight_before_sleeping(engine: AsyncEngine) -> None:
    sink: list[RequestOutput] = []
    tasks = [asyncio.create_task(final(engine, p, greedy(40), sink)) for p in PROMPTS]
    await outputs_arrived(sink)
    await engine.sleep(level=1, mode="wait")
    assert all(task.done() for task in tasks)
    assert [task.result().finish_reason for task in tasks] == ["length"] * len(PROMPTS)
    assert all(len(task.result().token_ids) == 40 for task in tasks)


async def test_a_request_submitted_during_the_wait_drain_completes_after_wake(engine: AsyncEngine) -> None:
    expected = await token_ids(engine, PROMPTS[:1], greedy())
    first: list[RequestOutput] = []
    in_flight = [asyncio.create_task(final(engine, p, greedy(40), first)) for p in PROMPTS]
    await outputs_arrived(first)
    sleeping = asyncio.create_task(engine.sleep(level=1, mode="wait"))
    await wait_until(lambda: engine.stats().draining or sleeping.done(), "draining")
    assert not sleeping.done() and not all(task.done() for task in in_flight), "the drain was already over"
    sink: list[RequestOutput] = []
    late = asyncio.create_task(final(engine, PROMPTS[0], greedy(), sink))
    await wait_until(lambda: engine.stats().requests_held == 1 or sleeping.done(), "the late request held")
    assert not sleeping.done(), "the drain was over before the late request came"
    async with asyncio.timeout(TIMEOUT):
        await sleeping
    assert all(task.done() for task in in_flight)
    await assert_queued_without_a_step(engine, sink)
    await engine.wake_up()
    assert list((await late).token_ids) == expected[0]


async def test_requests_submitted_while_asleep_complete_after_wake(engine: AsyncEngine) -> None:
    expected = await token_ids(engine, PROMPTS, greedy())
    await engine.sleep(level=1)
    sink: list[RequestOutput] = []
    tasks = [asyncio.create_task(final(engine, p, greedy(), sink)) for p in PROMPTS]
    await assert_queued_without_a_step(engine, sink, queued=len(PROMPTS))
    await engine.wake_up()
    assert [list(o.token_ids) for o in await asyncio.gather(*tasks)] == expected


async def test_a_request_held_by_the_wait_drain_can_be_aborted_and_never_runs(engine: AsyncEngine) -> None:
    alone = await token_ids(engine, PROMPTS[:1], greedy())
    expected = await token_ids(engine, PROMPTS, greedy(40))
    first: list[RequestOutput] = []
    in_flight = [asyncio.create_task(final(engine, p, greedy(40), first)) for p in PROMPTS]
    await outputs_arrived(first)
    sleeping = asyncio.create_task(engine.sleep(level=1, mode="wait"))
    await wait_until(lambda: engine.stats().draining or sleeping.done(), "draining")
    held: list[RequestOutput] = []

    async def consume() -> None:
        async for out in engine.generate(PROMPTS[0], greedy(), request_id="held"):
            held.append(out)

    late = asyncio.create_task(consume())
    await wait_until(lambda: engine.stats().requests_held == 1 or sleeping.done(), "the new request held")
    assert not sleeping.done(), "the drain was over before the new request came"
    assert await engine.abort("held") is True
    await asyncio.wait_for(late, TIMEOUT)
    assert [(o.finished, o.finish_reason, o.token_ids) for o in held] == [(True, "abort", [])]
    assert engine.stats().requests_held == 0
    await asyncio.wait_for(sleeping, TIMEOUT)
    assert [list(o.token_ids) for o in await asyncio.gather(*in_flight)] == expected
    steps = engine.stats().num_steps
    await engine.wake_up()
    await engine.collective_rpc(lambda worker: None)  # behind any step the wake let the loop submit
    await wait_until_idle(engine)
    assert engine.stats().num_steps == steps, "the aborted request ran after the wake"
    assert await token_ids(engine, PROMPTS[:1], greedy()) == alone  # and the engine serves as before


def fail_sleep(worker: Any) -> None:
    """The worker's sleep raises from now on (an instance attribute shadows the method)."""

    def sleep(level: int = 1) -> None:
        raise RuntimeError("injected sleep failure")

    worker.sleep = sleep


@pytest.mark.parametrize("mode", ["keep", "wait"])
async def test_a_failed_sleep_changes_nothing_and_the_requests_in_flight_finish_as_if_uninterrupted(
    engine: AsyncEngine, mode: str
) -> None:
    uninterrupted = await token_ids(engine, PROMPTS, greedy(40))
    await engine.collective_rpc(fail_sleep)
    sinks: list[list[RequestOutput]] = [[] for _ in PROMPTS]
    tasks = [asyncio.create_task(final(engine, p, greedy(40), sink)) for p, sink in zip(PROMPTS, sinks, strict=True)]
    await wait_until(lambda: all(sinks), "every request mid-generation")
    with pytest.raises(RuntimeError, match="injected sleep failure"):
        await engine.sleep(level=1, mode=mode)
    assert not await engine.is_sleeping()
    stats = engine.stats()
    assert (stats.sleeping, stats.weights_valid, stats.draining, stats.dead) == ((), True, False, False), stats
    assert await engine.collective_rpc(lambda worker: worker.is_sleeping()) == [[]]
    assert [list(o.token_ids) for o in await asyncio.gather(*tasks)] == uninterrupted
    assert await token_ids(engine, PROMPTS, greedy(40)) == uninterrupted  # and new requests run
