"""A rank's faults under tensor parallelism (``distributed_executor_backend = "mp"``, gloo on CPU).

The KV cache has only the blocks the smallest rank can hold. When one rank is killed, or hangs in a model step
past ``parallel.step_timeout_s``, every stream ends with an error naming that rank within a bound, the engine
is dead, and no worker process is left behind. Each test builds its own engine, which it leaves killed or hung.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from aioengine import AsyncEngine, SamplingParams
from aioengine.errors import EngineDeadError, RequestAbortedError
from aioengine.executor.multiproc import MultiprocExecutor
from tests.helpers import TIMEOUT, final, wait_until
from tests.test_tensor_parallel import GREEDY, PROMPTS, TP, tp_config

BOUND = 10.0
"""Seconds from a rank's death (or its step's deadline) to the end of every stream."""


def ranks_alive(executor: MultiprocExecutor) -> list[bool]:
    return [p.is_alive() for p in executor.processes]


async def stream_errors(engine: AsyncEngine, after_first: Any) -> tuple[list[BaseException | None], float]:
    """Starts every prompt, waits until each has a token, runs ``after_first()``; returns each stream's end
    and the seconds from ``after_first`` to the last end."""
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    started = [asyncio.Event() for _ in PROMPTS[:2]]

    async def consume(prompt: list[int], first: asyncio.Event) -> None:
        async for _ in engine.generate(prompt, long):
            first.set()

    tasks = [asyncio.ensure_future(consume(p, e)) for p, e in zip(PROMPTS[:2], started, strict=True)]
    async with asyncio.timeout(TIMEOUT):
        await asyncio.gather(*(e.wait() for e in started))
    await after_first()
    at = time.monotonic()
    async with asyncio.timeout(TIMEOUT):
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return list(results), time.monotonic() - at


async def test_the_kv_cache_is_the_smallest_ranks_and_killing_one_rank_ends_every_stream_leaving_no_process(
    llama_ckpt: Path,
) -> None:
    # Rank 1 offers half the KV memory of rank 0: the cache has the blocks the smaller rank can hold.
    memory = 4 << 20
    config = tp_config(
        llama_ckpt,
        cache={"num_blocks": None, "kv_cache_memory_bytes": memory},
        parallel={"worker_cls": "tests.worker_extensions.HalfMemoryOnRank1Worker"},
    )
    engine = AsyncEngine(config)
    await engine.start()
    executor = engine.executor
    assert isinstance(executor, MultiprocExecutor)
    try:
        block_bytes = await engine.collective_rpc("get_cache_block_size_bytes", unique_reply_rank=0)
        assert engine.stats().kv_blocks_total == memory // 2 // block_bytes - 1  # block 0 is the null block
        pids = await engine.collective_rpc(lambda worker: os.getpid())

        async def kill_rank_1() -> None:
            os.kill(pids[1], signal.SIGKILL)

        results, seconds = await stream_errors(engine, kill_rank_1)
        assert all(isinstance(r, RequestAbortedError) for r in results), results
        assert f"worker rank 1 (pid {pids[1]}) was killed by signal SIGKILL" in str(results[0])
        assert seconds < BOUND
        assert engine.stats().dead
    finally:
        await asyncio.wait_for(engine.shutdown(), TIMEOUT)
    assert ranks_alive(executor) == [False] * TP
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # reaped, not a zombie
            os.kill(pid, 0)


async def test_a_rank_that_hangs_is_detected_within_the_step_timeout(llama_ckpt: Path) -> None:
    timeout = 2.0
    engine = AsyncEngine(tp_config(llama_ckpt, cache={"num_blocks": 64}, parallel={"step_timeout_s": timeout}))
    await engine.start()
    executor = engine.executor
    assert isinstance(executor, MultiprocExecutor)
    try:

        def hang_rank_1_from_the_next_step(worker: Any) -> None:
            if worker.rank == 1:  # the instance attribute shadows the method: the next step never returns
                worker.execute_model = lambda *args: time.sleep(3600)

        async def hang() -> None:
            await engine.collective_rpc(hang_rank_1_from_the_next_step)

        results, seconds = await stream_errors(engine, hang)
        assert all(isinstance(r, RequestAbortedError) for r in results), results
        # Rank 0 waits in a collective for rank 1, so both are late; either way the hung rank is named.
        message = str(results[0])
        assert "did not finish a model step within parallel.step_timeout_s=2s (hung)" in message
        assert "[1]" in message or "[0, 1]" in message
        assert seconds < timeout + BOUND
        await wait_until(lambda: not ranks_alive(executor)[1], "the hung rank killed")
    finally:
        await asyncio.wait_for(engine.shutdown(), TIMEOUT)
    assert ranks_alive(executor) == [False] * TP
    with pytest.raises(EngineDeadError):
        await final(engine, [1, 2, 3], GREEDY)
