"""Hot weight swap with 30 streams in flight: the defined outcome of each mode (pause, drain,
abort, recompute), and that requests sent during the swap finish. Set-up: weight_swap_support."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aioengine import AsyncEngine, RequestOutput
from tests.helpers import TIMEOUT
from tests.weight_swap_support import MODES, NEW_TOKENS, NUM_LATE, NUM_STREAMS, PROMPTS, greedy, hf_greedy


# ---- 30 streams in flight during a swap ------------------------------------------------------------------
@dataclass
class Stream:
    """One request's outputs: each token with the weights_version it was published under."""

    prompt: int
    tokens: list[tuple[int, int]] = field(default_factory=list)
    last: RequestOutput | None = None

    @property
    def ids(self) -> list[int]:
        return [t for t, _ in self.tokens]

    def before_swap(self, old_version: int) -> list[int]:
        return [t for t, v in self.tokens if v == old_version]


@dataclass
class SwapRun:
    report: dict[str, Any]
    old_version: int
    in_flight: list[Stream]
    late: list[Stream]
    stats: dict[str, Any]


async def consume(engine: AsyncEngine, stream: Stream, progressed: Callable[[], None]) -> Stream:
    async with asyncio.timeout(TIMEOUT):
        async for out in engine.generate(PROMPTS[stream.prompt], greedy()):
            # A lagging consumer gets merged outputs, but never across weights: every token of one
            # output was computed with the version it carries.
            stream.tokens += [(t, out.weights_version) for t in out.delta_token_ids]
            stream.last = out
            progressed()
    return stream


async def swap_under_load(engine: AsyncEngine, source: Path, mode: str) -> SwapRun:
    """30 greedy streams; once each has 2 tokens, ``update_weights(source, mode)``; while it runs, 5 more."""
    old_version = engine.weights_version
    all_started = asyncio.Event()
    in_flight = [Stream(i) for i in range(NUM_STREAMS)]

    def progressed() -> None:
        if all(len(s.tokens) >= 2 for s in in_flight):
            all_started.set()

    tasks = [asyncio.create_task(consume(engine, s, progressed)) for s in in_flight]
    async with asyncio.timeout(TIMEOUT):
        await all_started.wait()
    update = asyncio.create_task(engine.update_weights(source, mode=mode))
    await asyncio.sleep(0)  # the update runs up to its first wait: admission held or steps paused
    assert not update.done()
    late = [Stream(i) for i in range(NUM_LATE)]
    tasks += [asyncio.create_task(consume(engine, s, lambda: None)) for s in late]
    async with asyncio.timeout(TIMEOUT):
        report = await update
        await asyncio.gather(*tasks)
    return SwapRun(report, old_version, in_flight, late, engine.stats())


@pytest.mark.parametrize("mode", MODES)
async def test_requests_sent_during_a_swap_finish_with_outputs_of_b_and_the_new_version(
    engine: AsyncEngine, mode: str, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    run = await swap_under_load(engine, ckpt_b, mode)
    assert [s.ids for s in run.late] == ref["B"][:NUM_LATE]
    assert all(v == run.old_version + 1 for s in run.late for _, v in s.tokens)


@pytest.mark.parametrize("mode", MODES)
async def test_every_kv_block_is_free_after_a_swap_under_load(engine: AsyncEngine, mode: str, ckpt_b: Path) -> None:
    run = await swap_under_load(engine, ckpt_b, mode)
    assert run.stats.kv_blocks_free == run.stats.kv_blocks_total
    assert run.stats.requests_running == run.stats.requests_waiting == 0


async def test_drain_finishes_in_flight_requests_entirely_on_a_with_the_old_version(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    run = await swap_under_load(engine, ckpt_b, "drain")
    assert [s.ids for s in run.in_flight] == ref["A"]
    assert all(v == run.old_version for s in run.in_flight for _, v in s.tokens)
    assert run.report.weights_version == run.old_version + 1


async def test_pause_lets_in_flight_requests_finish_with_a_tokens_then_new_version_tokens(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    run = await swap_under_load(engine, ckpt_b, "pause")
    for s in run.in_flight:
        assert s.last is not None and s.last.finish_reason == "length" and len(s.ids) == NEW_TOKENS
        old = s.before_swap(run.old_version)
        assert old == ref["A"][s.prompt][: len(old)]  # computed before the swap: A's
        assert s.ids[len(old) :] and all(v == run.old_version + 1 for _, v in s.tokens[len(old) :])
    # The tokens after the swap came from B: on a random pair of models, at least one departs from A.
    assert any(s.ids != ref["A"][s.prompt] for s in run.in_flight)


async def test_recompute_continues_in_flight_requests_exactly_as_b_would_from_their_a_tokens(
    engine: AsyncEngine, llama_ckpt: Path, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    run = await swap_under_load(engine, ckpt_b, "recompute")
    kept = [s.before_swap(run.old_version) for s in run.in_flight]
    assert kept == [ref["A"][s.prompt][: len(k)] for s, k in zip(run.in_flight, kept, strict=True)]
    # Their KV is recomputed under B, so the rest is HF's greedy of B from prompt + the kept tokens.
    rest = hf_greedy(ckpt_b, [PROMPTS[s.prompt] + k for s, k in zip(run.in_flight, kept, strict=True)],
                     [NEW_TOKENS - len(k) for k in kept])  # fmt: skip
    assert [s.ids for s in run.in_flight] == [k + r for k, r in zip(kept, rest, strict=True)]


async def test_recompute_reports_every_request_it_preempted_mid_generation(engine: AsyncEngine, ckpt_b: Path) -> None:
    run = await swap_under_load(engine, ckpt_b, "recompute")
    mid_generation = [s for s in run.in_flight if len(s.before_swap(run.old_version)) < NEW_TOKENS]
    assert len(mid_generation) > 0
    assert run.report.preempted == len(mid_generation)
    assert all(s.last is not None and s.last.num_preemptions >= 1 for s in mid_generation)


async def test_abort_ends_in_flight_requests_with_abort_and_reports_how_many(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    run = await swap_under_load(engine, ckpt_b, "abort")
    ended = [s for s in run.in_flight if s.last is not None and s.last.finish_reason == "abort"]
    finished = [s for s in run.in_flight if s not in ended]
    assert len(ended) > 0 and run.report.aborted == len(ended)
    assert all(s.ids == ref["A"][s.prompt][: len(s.ids)] for s in ended)  # cut short, A's so far
    assert all(s.ids == ref["A"][s.prompt] for s in finished)  # any that ended before the swap
