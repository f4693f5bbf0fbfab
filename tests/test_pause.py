"""pause_generation / resume_generation: what each mode (abort / wait / keep) does to the requests in flight,
requests sent while paused, and the other control calls (sleep, wake, weight updates) under a pause."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from aioengine.engine.control import PauseMode
from aioengine.errors import EngineStateError
from tests.engine_request_support import greedy
from tests.helpers import TIMEOUT, wait_until, wait_until_idle
from tests.sleep_support import assert_queued_without_a_step, final, token_ids
from tests.weight_swap_support import NEW_TOKENS, hf_greedy
from tests.weight_swap_support import PROMPTS as SWAP_PROMPTS

PROMPTS = [f"request {i}: the weather today" for i in range(20)]
MAX_TOKENS = 40


@pytest.fixture
async def engine(llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]) -> AsyncIterator[AsyncEngine]:
    async with make_engine(llama_ckpt) as engine:
        yield engine


class Streams:
    """Requests streamed in background tasks, each output kept as it arrives."""

    def __init__(self, engine: AsyncEngine, prompts: list[str] | list[list[int]], params: SamplingParams) -> None:
        self.sinks: list[list[RequestOutput]] = [[] for _ in prompts]
        self.tasks = [
            asyncio.create_task(final(engine, p, params, sink)) for p, sink in zip(prompts, self.sinks, strict=True)
        ]

    async def started(self) -> None:
        """Returns once every request has streamed a token (all are mid-generation)."""
        await wait_until(lambda: all(self.sinks), "every request streamed a token")

    def counts(self) -> list[int]:
        return [len(sink[-1].token_ids) if sink else 0 for sink in self.sinks]

    async def results(self) -> list[RequestOutput]:
        async with asyncio.timeout(TIMEOUT):
            return await asyncio.gather(*self.tasks)


async def settle(engine: AsyncEngine) -> None:
    """Gives the loop every chance to step: an RPC runs behind any step submitted, then a few loop turns."""
    await engine.collective_rpc(lambda worker: None)
    for _ in range(5):
        await asyncio.sleep(0)


# ---- the three modes, with 20 streams in flight ----------------------------------------------------------
async def test_abort_mode_ends_every_stream_in_flight_with_finish_reason_abort(engine: AsyncEngine) -> None:
    streams = Streams(engine, PROMPTS, greedy(400, ignore_eos=True))
    await streams.started()
    report = await engine.pause_generation(mode="abort")
    outs = await streams.results()
    assert (report.mode, report.aborted) == ("abort", len(PROMPTS))
    assert [o.finish_reason for o in outs] == ["abort"] * len(PROMPTS)
    stats = engine.stats()
    assert stats.paused and stats.kv_blocks_free == stats.kv_blocks_total


async def test_wait_mode_finishes_every_stream_in_flight_before_it_returns(engine: AsyncEngine) -> None:
    streams = Streams(engine, PROMPTS, greedy(MAX_TOKENS, ignore_eos=True))
    await streams.started()
    report = await engine.pause_generation(mode="wait")
    stats = engine.stats()
    assert (stats.requests_running, stats.requests_waiting, stats.kv_blocks_free) == (0, 0, stats.kv_blocks_total)
    assert all(task.done() for task in streams.tasks)
    outs = await streams.results()
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("length", MAX_TOKENS)] * len(PROMPTS)
    assert (report.mode, report.aborted) == ("wait", 0)
    assert await engine.is_paused()


async def test_keep_mode_freezes_streams_and_after_resume_they_finish_as_an_uninterrupted_run(
    engine: AsyncEngine,
) -> None:
    params = greedy(MAX_TOKENS, ignore_eos=True)
    uninterrupted = await token_ids(engine, PROMPTS, params)
    streams = Streams(engine, PROMPTS, params)
    await streams.started()
    report = await engine.pause_generation(mode="keep")
    stats = engine.stats()
    await settle(engine)
    frozen = streams.counts()
    assert all(0 < n < MAX_TOKENS for n in frozen), frozen
    await settle(engine)
    assert streams.counts() == frozen, "a request advanced while paused"
    after = engine.stats()
    assert (after.num_steps, after.num_generated_tokens) == (stats.num_steps, stats.num_generated_tokens)
    assert after.requests_running == len(PROMPTS) and after.num_preemptions == stats.num_preemptions
    assert not any(task.done() for task in streams.tasks)
    assert (report.mode, report.aborted) == ("keep", 0)
    await engine.resume_generation()
    outs = await streams.results()
    assert [list(o.token_ids) for o in outs] == uninterrupted
    assert all(o.finish_reason == "length" and o.num_preemptions == 0 for o in outs)


# ---- requests sent while paused ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_requests_sent_while_paused_are_accepted_wait_and_finish_after_resume(
    engine: AsyncEngine, mode: PauseMode
) -> None:
    prompts = PROMPTS[:5]
    expected = await token_ids(engine, prompts, greedy(12, ignore_eos=True))
    await engine.pause_generation(mode=mode)
    sink: list[RequestOutput] = []
    tasks = [asyncio.create_task(final(engine, p, greedy(12, ignore_eos=True), sink)) for p in prompts]
    await assert_queued_without_a_step(engine, sink, queued=len(prompts))
    await engine.resume_generation()
    async with asyncio.timeout(TIMEOUT):
        assert [list(o.token_ids) for o in await asyncio.gather(*tasks)] == expected


# ---- state, reports, a bad mode ---------------------------------------------------------------------------
async def test_is_paused_and_stats_paused_follow_pause_and_resume(engine: AsyncEngine) -> None:
    assert not await engine.is_paused() and not engine.stats().paused
    await engine.pause_generation(mode="keep")
    assert await engine.is_paused() and engine.stats().paused
    await engine.resume_generation()
    assert not await engine.is_paused() and not engine.stats().paused
    assert engine.stats().to_dict()["paused"] is False


async def test_resume_when_not_paused_changes_nothing(engine: AsyncEngine) -> None:
    expected = await token_ids(engine, PROMPTS[:3], greedy(12))
    await engine.resume_generation()
    assert not await engine.is_paused()
    assert await token_ids(engine, PROMPTS[:3], greedy(12)) == expected


async def test_a_bad_mode_raises_value_error_naming_it_and_pauses_nothing(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match=r"pause mode .*'freeze'"):
        await engine.pause_generation(mode="freeze")  # type: ignore[arg-type]
    assert not await engine.is_paused()


async def test_pausing_again_in_keep_mode_changes_nothing_and_says_so(engine: AsyncEngine) -> None:
    streams = Streams(engine, PROMPTS[:5], greedy(MAX_TOKENS, ignore_eos=True))
    await streams.started()
    await engine.pause_generation(mode="keep")
    steps = engine.stats().num_steps
    again = await engine.pause_generation(mode="keep")
    assert (again.aborted, again.notes) == (0, ("already paused",))
    await settle(engine)
    assert engine.stats().num_steps == steps and engine.stats().requests_running == 5
    await engine.resume_generation()
    assert all(o.finish_reason == "length" for o in await streams.results())


async def test_pausing_again_in_abort_mode_ends_what_is_queued(engine: AsyncEngine) -> None:
    await engine.pause_generation(mode="keep")
    sink: list[RequestOutput] = []
    tasks = [asyncio.create_task(final(engine, p, greedy(12), sink)) for p in PROMPTS[:4]]
    await wait_until(lambda: engine.stats().requests_waiting == 4, "4 requests queued", state=engine.stats)
    report = await engine.pause_generation(mode="abort")
    async with asyncio.timeout(TIMEOUT):
        outs = await asyncio.gather(*tasks)
    assert report.aborted == 4 and [o.finish_reason for o in outs] == ["abort"] * 4
    assert await engine.is_paused()
    await engine.resume_generation()
    await wait_until_idle(engine)


async def test_a_pause_cancelled_during_its_wait_drain_leaves_the_engine_running_and_loses_nothing(
    engine: AsyncEngine,
) -> None:
    streams = Streams(engine, PROMPTS[:5], greedy(200, ignore_eos=True))
    await streams.started()
    pausing = asyncio.create_task(engine.pause_generation(mode="wait"))
    await wait_until(lambda: engine.stats().draining, "the pause drains")
    late: list[RequestOutput] = []
    held = asyncio.create_task(final(engine, PROMPTS[5], greedy(12), late))
    await wait_until(lambda: engine.stats().requests_held == 1, "a request sent during the drain is held")
    pausing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pausing
    assert not await engine.is_paused() and not engine.stats().draining
    assert [len(o.token_ids) for o in await streams.results()] == [200] * 5
    async with asyncio.timeout(TIMEOUT):
        assert len((await held).token_ids) == 12


# ---- other control calls while paused ---------------------------------------------------------------------
@pytest.mark.parametrize("call", ["sleep wait", "update_weights drain", "pause wait"])
async def test_a_call_that_must_drain_while_paused_with_requests_refuses_naming_the_pause(
    engine: AsyncEngine, call: str
) -> None:
    streams = Streams(engine, PROMPTS[:5], greedy(MAX_TOKENS, ignore_eos=True))
    await streams.started()
    await engine.pause_generation(mode="keep")
    steps = engine.stats().num_steps
    refused = pytest.raises(EngineStateError, match=r"paused.*resume_generation\(\) first, or choose another mode")
    with refused:
        async with asyncio.timeout(TIMEOUT):  # never a hang, whatever a drain under a pause did
            if call == "sleep wait":
                await engine.sleep(level=1, mode="wait")
            elif call == "update_weights drain":
                await engine.reload_weights(mode="drain")
            else:
                await engine.pause_generation(mode="wait")
    stats = engine.stats()
    assert (stats.paused, stats.sleeping, stats.weights_version, stats.draining) == (True, (), 0, False)
    assert stats.num_steps == steps
    await engine.resume_generation()
    outs = await streams.results()
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("length", MAX_TOKENS)] * 5


async def test_a_wait_sleep_while_paused_with_nothing_queued_sleeps(engine: AsyncEngine) -> None:
    await engine.pause_generation(mode="keep")
    report = await engine.sleep(level=1, mode="wait")
    assert report.freed_bytes.kv_cache > 0 and await engine.is_sleeping()
    await engine.wake_up()
    assert await engine.is_paused()


async def test_sleep_keep_and_wake_while_paused_then_resume_finish_as_an_uninterrupted_run(
    engine: AsyncEngine,
) -> None:
    params = greedy(MAX_TOKENS, ignore_eos=True)
    uninterrupted = await token_ids(engine, PROMPTS, params)
    streams = Streams(engine, PROMPTS, params)
    await streams.started()
    await engine.pause_generation(mode="keep")
    sleep = await engine.sleep(level=1, mode="keep")
    assert sleep.preempted == len(PROMPTS)
    await engine.wake_up()
    steps = engine.stats().num_steps
    await settle(engine)
    assert engine.stats().num_steps == steps, "a step ran after the wake although the engine is paused"
    await engine.resume_generation()
    assert [list(o.token_ids) for o in await streams.results()] == uninterrupted


async def test_pause_keep_then_update_weights_then_resume_goes_on_with_the_new_weights(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    prompts = SWAP_PROMPTS[:20]
    streams = Streams(engine, prompts, greedy(NEW_TOKENS, ignore_eos=True))
    await streams.started()
    await engine.pause_generation(mode="keep")
    await settle(engine)
    kept = [list(sink[-1].token_ids) for sink in streams.sinks]
    assert kept == [r[: len(k)] for r, k in zip(ref["A"][:20], kept, strict=True)]  # A's, as far as they got
    report = await engine.update_weights(ckpt_b, mode="pause")
    assert report.weights_version == 1 and (report.aborted, report.preempted) == (0, 0)
    await settle(engine)
    assert streams.counts() == [len(k) for k in kept], "a request advanced between the update and the resume"
    await engine.resume_generation()
    outs = await streams.results()
    assert all(o.finish_reason == "length" and o.weights_version == 1 for o in outs)
    for sink, k in zip(streams.sinks, kept, strict=True):
        later = [o for o in sink if len(o.token_ids) > len(k)]
        assert later and all(o.weights_version == 1 for o in later)  # every token after the pause: B's weights
        assert list(sink[-1].token_ids[: len(k)]) == k
    # The KV kept from A stays, so the rest is not B's greedy from scratch; but B's weights show.
    assert any(list(o.token_ids) != r for o, r in zip(outs, ref["A"][:20], strict=True))


async def test_pause_keep_then_a_recompute_update_then_resume_continues_exactly_as_b_would(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    prompts = SWAP_PROMPTS[:20]
    streams = Streams(engine, prompts, greedy(NEW_TOKENS, ignore_eos=True))
    await streams.started()
    await engine.pause_generation(mode="keep")
    await settle(engine)
    kept = [list(sink[-1].token_ids) for sink in streams.sinks]
    report = await engine.update_weights(ckpt_b, mode="recompute")
    assert report.preempted == len(prompts)
    await engine.resume_generation()
    outs = await streams.results()
    rest = hf_greedy(ckpt_b, [p + k for p, k in zip(prompts, kept, strict=True)], [NEW_TOKENS - len(k) for k in kept])
    assert [list(o.token_ids) for o in outs] == [k + r for k, r in zip(kept, rest, strict=True)]
