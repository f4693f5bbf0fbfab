"""The multi-process executor (parallel.distributed_executor_backend = "mp"): each worker in its own process.

Most tests share one engine (module scope, on the module's event loop) and leave it as they found it.
The engine whose worker is killed is shared by the tests that read what the kill did; the tests of
start and shutdown build engines of their own.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from aioengine import AsyncEngine, SamplingParams
from aioengine.config import EngineConfig
from aioengine.errors import AIOEngineError, CheckpointError, EngineDeadError, RequestAbortedError
from aioengine.executor.multiproc import MultiprocExecutor
from aioengine.messages import ModelInfo
from tests.conftest import engine_config
from tests.helpers import TIMEOUT, final, process_gone, wait_until
from tests.weight_swap_support import hf_greedy

MAX_BATCHED_TOKENS = 32
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [[5, 9, 13, 17], list(range(3, 83)), [100, 200, 300, 400, 500], [42] * 9]
"""The second is longer than MAX_BATCHED_TOKENS: its prefill takes three chunks."""
DEATH_BOUND = 10.0
"""Seconds from a worker's death to the end of every stream."""

in_module_loop = pytest.mark.asyncio(loop_scope="module")


def mp_config(path: Path, backend: str = "mp", **sections: Any) -> EngineConfig:
    parallel = {"distributed_executor_backend": backend, **sections.pop("parallel", {})}
    scheduler = {"max_num_batched_tokens": MAX_BATCHED_TOKENS, **sections.pop("scheduler", {})}
    return engine_config(path, parallel=parallel, cache={"num_blocks": 128}, scheduler=scheduler, **sections)


def executor_of(engine: AsyncEngine) -> MultiprocExecutor:
    assert isinstance(engine.executor, MultiprocExecutor)
    return engine.executor


async def greedy(engine: AsyncEngine, prompts: Sequence[list[int]] = PROMPTS) -> list[list[int]]:
    """Greedy tokens of every prompt, all generated concurrently."""
    outs = await asyncio.gather(*(final(engine, p, GREEDY) for p in prompts))
    return [list(out.token_ids) for out in outs]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mp_engine(llama_ckpt: Path) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(mp_config(llama_ckpt)) as engine:
        yield engine


# ---- the worker process and the calls into it ----------------------------------------------------------
@in_module_loop
async def test_a_callable_runs_in_the_worker_process_and_returns_one_result_per_rank(mp_engine: AsyncEngine) -> None:
    pids = await mp_engine.collective_rpc(lambda worker: os.getpid())
    assert pids == executor_of(mp_engine).pids
    assert pids[0] != os.getpid()


@in_module_loop
async def test_greedy_tokens_over_mp_equal_those_over_the_thread_executor(
    mp_engine: AsyncEngine, llama_ckpt: Path
) -> None:
    assert len(PROMPTS[1]) > MAX_BATCHED_TOKENS  # chunked prefill is part of it
    over_mp = await greedy(mp_engine)
    async with AsyncEngine(mp_config(llama_ckpt, backend="thread")) as threaded:
        assert over_mp == await greedy(threaded)
    assert all(len(tokens) == NEW_TOKENS for tokens in over_mp)


@in_module_loop
async def test_the_worker_process_froze_its_start_up_heap_after_its_warm_up(mp_engine: AsyncEngine) -> None:
    [frozen] = await mp_engine.collective_rpc(lambda worker: gc.get_freeze_count())
    assert frozen > 0


async def test_freeze_gc_off_leaves_the_worker_process_s_collector_alone(llama_ckpt: Path) -> None:
    async with AsyncEngine(mp_config(llama_ckpt, scheduler={"freeze_gc": False})) as engine:
        assert await engine.collective_rpc(lambda worker: gc.get_freeze_count()) == [0]


@in_module_loop
async def test_collective_rpc_by_name_returns_one_result_per_rank(mp_engine: AsyncEngine, llama_ckpt: Path) -> None:
    [info] = await mp_engine.collective_rpc("get_model_info")
    assert isinstance(info, ModelInfo)
    assert info.model_path == str(llama_ckpt)


@in_module_loop
async def test_unique_reply_rank_returns_that_rank_s_result_alone(mp_engine: AsyncEngine) -> None:
    assert await mp_engine.collective_rpc(lambda worker: worker.rank, unique_reply_rank=0) == 0


@in_module_loop
async def test_a_worker_exception_arrives_with_its_type_and_message(mp_engine: AsyncEngine) -> None:
    def refuse(worker: Any) -> None:
        raise CheckpointError(f"rank {worker.rank} refuses tensor 'lm_head.weight'")

    with pytest.raises(CheckpointError, match=r"rank 0 refuses tensor 'lm_head\.weight'") as caught:
        await mp_engine.collective_rpc(refuse)
    assert any("raised in worker rank 0" in note for note in caught.value.__notes__)


@in_module_loop
async def test_an_exception_that_cannot_be_rebuilt_arrives_as_runtime_error_with_its_traceback(
    mp_engine: AsyncEngine,
) -> None:
    def fail(worker: Any) -> None:
        class TwoArgError(Exception):
            def __init__(self, what: str, why: str) -> None:
                super().__init__(f"{what}: {why}")  # pickles as one arg, so it cannot be rebuilt

        raise TwoArgError("layer 3", "broken")

    with pytest.raises(RuntimeError, match=r"(?s)TwoArgError: layer 3: broken.*Traceback.*in fail"):
        await mp_engine.collective_rpc(fail)


@in_module_loop
async def test_a_result_that_cannot_be_pickled_arrives_as_runtime_error_naming_its_type(mp_engine: AsyncEngine) -> None:
    with pytest.raises(RuntimeError, match=r"the result \(lock\) cannot be sent to the engine process"):
        await mp_engine.collective_rpc(lambda worker: threading.Lock())


@in_module_loop
async def test_an_rpc_past_its_timeout_raises_timeout_error_naming_the_method(mp_engine: AsyncEngine) -> None:
    def hold_the_worker(worker: Any) -> None:
        time.sleep(0.5)

    with pytest.raises(TimeoutError, match="hold_the_worker"):
        await mp_engine.collective_rpc(hold_the_worker, timeout=0.05)
    executor = executor_of(mp_engine)
    await wait_until(lambda: not executor.overdue_calls(), "done with the timed-out call")


@in_module_loop
async def test_a_timed_out_rpc_is_reported_overdue_until_it_returns(mp_engine: AsyncEngine) -> None:
    def keep_the_worker(worker: Any) -> str:
        time.sleep(0.5)
        return "done"

    executor = executor_of(mp_engine)
    with pytest.raises(TimeoutError):
        await mp_engine.collective_rpc(keep_the_worker, timeout=0.05)
    assert [call for call in executor.overdue_calls() if "keep_the_worker" in call]
    await wait_until(lambda: not executor.overdue_calls(), "done with the timed-out call")
    assert await mp_engine.collective_rpc("get_cache_block_size_bytes", unique_reply_rank=0) > 0


@in_module_loop
async def test_arguments_that_cannot_be_pickled_are_refused_naming_the_method(mp_engine: AsyncEngine) -> None:
    with pytest.raises(TypeError, match=r"'update_weights'.*cannot be sent to a worker process"):
        await mp_engine.collective_rpc("update_weights", ((name, None) for name in ["lm_head.weight"]))


# ---- sleep and weights ------------------------------------------------------------------------------
@in_module_loop
async def test_sleep_level_1_and_wake_give_the_same_greedy_tokens(mp_engine: AsyncEngine) -> None:
    before = await greedy(mp_engine)
    await mp_engine.sleep(level=1)
    assert mp_engine.stats().sleeping
    await mp_engine.wake_up()
    assert await greedy(mp_engine) == before


@in_module_loop
async def test_update_weights_gives_the_new_checkpoint_s_tokens(mp_engine: AsyncEngine, ckpt_b: Path) -> None:
    prompts = PROMPTS[:2]
    before = await greedy(mp_engine, prompts)
    await mp_engine.update_weights(str(ckpt_b))
    try:
        assert await greedy(mp_engine, prompts) == hf_greedy(ckpt_b, prompts, NEW_TOKENS)
    finally:
        await mp_engine.reload_weights()  # the shared engine serves its own checkpoint again
    assert await greedy(mp_engine, prompts) == before


@in_module_loop
async def test_run_aside_runs_while_a_call_holds_the_step_lane(mp_engine: AsyncEngine, tmp_path: Path) -> None:
    flag = tmp_path / "holding"

    def hold_the_worker(worker: Any) -> None:
        flag.touch()
        time.sleep(2.0)

    held = asyncio.ensure_future(mp_engine.collective_rpc(hold_the_worker))
    await wait_until(flag.exists, "inside the call that holds the step lane")
    [info] = await executor_of(mp_engine).run_aside("get_model_info")
    assert isinstance(info, ModelInfo)
    assert not held.done(), "run_aside waited for the step lane"
    await held


# ---- a worker process that dies -------------------------------------------------------------------------
@dataclass
class Killed:
    engine: AsyncEngine
    pid: int
    results: list[BaseException | None]
    seconds: float
    """From the kill to the end of the last stream."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def killed(llama_ckpt: Path) -> AsyncIterator[Killed]:
    """An engine whose worker process was killed (SIGKILL) while every prompt was generating."""
    engine = AsyncEngine(mp_config(llama_ckpt))
    await engine.start()
    try:
        [pid] = await engine.collective_rpc(lambda worker: os.getpid())
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        started = [asyncio.Event() for _ in PROMPTS]

        async def consume(prompt: list[int], first: asyncio.Event) -> None:
            async for _ in engine.generate(prompt, long):
                first.set()

        tasks = [asyncio.ensure_future(consume(p, e)) for p, e in zip(PROMPTS, started, strict=True)]
        async with asyncio.timeout(TIMEOUT):
            await asyncio.gather(*(e.wait() for e in started))
        os.kill(pid, signal.SIGKILL)
        at = time.monotonic()
        async with asyncio.timeout(TIMEOUT):
            results = await asyncio.gather(*tasks, return_exceptions=True)
        yield Killed(engine, pid, list(results), time.monotonic() - at)
    finally:
        await engine.shutdown()


@in_module_loop
async def test_killing_the_worker_ends_every_stream_with_an_error_within_the_bound(killed: Killed) -> None:
    assert all(isinstance(r, RequestAbortedError) for r in killed.results), killed.results
    assert killed.seconds < DEATH_BOUND


@in_module_loop
async def test_the_stream_error_names_the_rank_the_pid_and_the_signal(killed: Killed) -> None:
    message = str(killed.results[0])
    assert f"worker rank 0 (pid {killed.pid}) was killed by signal SIGKILL" in message


@in_module_loop
async def test_a_killed_worker_leaves_the_engine_dead(killed: Killed) -> None:
    assert killed.engine.stats().dead
    with pytest.raises(EngineDeadError):
        await final(killed.engine, [1, 2, 3], GREEDY)


@in_module_loop
async def test_every_later_call_to_the_executor_fails_naming_the_dead_rank(killed: Killed) -> None:
    executor = executor_of(killed.engine)
    with pytest.raises(EngineDeadError, match="worker rank 0"):
        await executor.collective_rpc("check_health")


@in_module_loop
async def test_shutdown_after_a_killed_worker_returns_and_leaves_no_process(killed: Killed) -> None:
    executor = executor_of(killed.engine)
    await asyncio.wait_for(killed.engine.shutdown(), TIMEOUT)
    assert not any(p.is_alive() for p in executor.processes)
    with pytest.raises(ProcessLookupError):  # reaped, not a zombie
        os.kill(killed.pid, 0)


# ---- start and shutdown ---------------------------------------------------------------------------------
async def test_shutdown_stops_the_worker_process_and_a_second_shutdown_is_safe(llama_ckpt: Path) -> None:
    engine = AsyncEngine(mp_config(llama_ckpt))
    await engine.start()
    executor = executor_of(engine)
    [process] = executor.processes
    assert process.is_alive()
    await engine.shutdown()
    assert process.exitcode == 0, "the worker process was not stopped by asking it"
    await engine.shutdown()
    executor.shutdown()
    assert not process.is_alive()


async def test_a_start_that_fails_in_the_worker_leaves_no_process(tmp_path: Path) -> None:
    before = set(multiprocessing.active_children())
    engine = AsyncEngine(mp_config(tmp_path / "no-such-checkpoint"))
    with pytest.raises(AIOEngineError, match="no-such-checkpoint"):
        await engine.start()
    assert not any(p.is_alive() for p in executor_of(engine).processes)
    assert set(multiprocessing.active_children()) - before == set()
    await engine.shutdown()


async def test_a_worker_that_cannot_be_built_fails_the_start_and_leaves_no_process(llama_ckpt: Path) -> None:
    before = set(multiprocessing.active_children())
    engine = AsyncEngine(mp_config(llama_ckpt, parallel={"worker_cls": "no_such_package.Worker"}))
    with pytest.raises(AIOEngineError, match=r"no_such_package\.Worker"):
        await engine.start()
    assert engine.executor is None
    assert set(multiprocessing.active_children()) - before == set()
    await engine.shutdown()


# ---- an engine process that dies -------------------------------------------------------------------------
ENGINE_SCRIPT = """
import asyncio, os, pathlib, sys, time
from aioengine import EngineConfig
from aioengine.executor.multiproc import MultiprocExecutor

def hold(worker, inside):
    inside.touch()
    time.sleep(600)

async def main():
    where = pathlib.Path(sys.argv[2])
    parallel = {"distributed_executor_backend": "mp"}
    executor = MultiprocExecutor(EngineConfig(model={"path": sys.argv[1]}, device={"device": "cpu"}, parallel=parallel))
    (where / "pid.tmp").write_text(str(executor.pids[0]))
    os.replace(where / "pid.tmp", where / "worker.pid")
    await executor.collective_rpc(hold, (where / "inside",))

asyncio.run(main())
"""
"""An engine process whose worker is inside a long call: writes ``worker.pid``, then the worker touches
``inside``, both in the directory ``argv[2]``."""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
async def test_the_worker_process_does_not_outlive_a_killed_engine_process_even_inside_a_call(
    llama_ckpt: Path, tmp_path: Path
) -> None:
    # No pipes to the engine process: the worker inherits them, and a live one would keep them open.
    engine_process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ENGINE_SCRIPT, str(llama_ckpt), str(tmp_path),
        stdout=asyncio.subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    try:
        await wait_until(
            lambda: (tmp_path / "inside").exists() or engine_process.returncode is not None, "inside the long call"
        )
        assert engine_process.returncode is None, "the engine process ended by itself (see its stderr)"
    finally:
        engine_process.kill()
        await engine_process.wait()
    worker = int((tmp_path / "worker.pid").read_text())
    try:
        await wait_until(lambda: process_gone(worker), "rid of the orphaned worker process", timeout=DEATH_BOUND)
    finally:
        if not process_gone(worker):
            os.kill(worker, signal.SIGKILL)  # the test failed: leave no orphan behind
