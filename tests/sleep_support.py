"""Helpers shared by the sleep / wake tests (test_sleep.py, test_sleep_modes.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from tests.helpers import TIMEOUT, wait_until

PROMPTS = ["The quick brown fox", "Once upon a time", "Sleep and wake", "0123456789", "hello hello hello"]


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def final(
    engine: AsyncEngine, prompt: Any, params: SamplingParams, sink: list[RequestOutput] | None = None
) -> RequestOutput:
    """Streams one request to its end; every output is appended to ``sink`` as it arrives."""
    out = None
    async with asyncio.timeout(TIMEOUT):
        async for out in engine.generate(prompt, params):
            if sink is not None:
                sink.append(out)
    assert out is not None and out.finished
    return out


async def token_ids(
    engine: AsyncEngine, prompts: list[str], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    """Runs ``prompts`` concurrently; returns each one's output token ids."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    outs = await asyncio.gather(*(final(engine, p, sp) for p, sp in zip(prompts, each, strict=True)))
    return [list(o.token_ids) for o in outs]


async def outputs_arrived(sink: list[RequestOutput], count: int = 1) -> None:
    """Returns once ``sink`` holds ``count`` outputs."""
    await wait_until(lambda: len(sink) >= count, f"{count} outputs streamed")


async def assert_queued_without_a_step(engine: AsyncEngine, sink: list[RequestOutput], queued: int = 1) -> None:
    """The ``queued`` requests just sent are accepted and wait, and the engine, given every chance, runs no step.

    A step the loop submitted would show: the RPC below runs behind it on the worker, and by the time
    the RPC's reply reaches us the loop has counted that step (or died of it on a sleeping worker).
    """
    steps = engine.stats().num_steps

    def settled() -> bool:  # queued, or (a failure) already run or dead
        stats = engine.stats()
        return stats.requests_waiting == queued or bool(sink) or stats.dead

    await wait_until(settled, f"{queued} requests queued", state=engine.stats)
    await engine.collective_rpc(lambda worker: None)  # ordered behind every step submitted so far
    for _ in range(3):
        await asyncio.sleep(0)  # the loop takes in what came back
    stats = engine.stats()
    assert sink == [], f"a request ran while the engine must not step: {sink[0]}"
    assert (stats.num_steps, stats.requests_waiting, stats.requests_running) == (steps, queued, 0), stats
    assert not stats.dead
