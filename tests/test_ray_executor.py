"""The Ray executor (parallel.distributed_executor_backend = "ray"): each rank a Ray actor.

Two ranks (tensor_parallel_size = 2) on a local Ray instance the module starts, which both engines join.
Most tests share one engine (module scope, on the module's event loop) and leave it as they found it;
the engine whose actor is killed is shared by the tests that read what the kill did. Without Ray
installed, only the test of the refused start runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import pytest_asyncio

from aioengine import AsyncEngine, SamplingParams
from aioengine.config import EngineConfig
from aioengine.errors import CheckpointError, ConfigurationError, EngineDeadError, RequestAbortedError
from aioengine.executor.ray import RayExecutor
from aioengine.messages import ModelInfo
from tests.conftest import engine_config
from tests.helpers import TIMEOUT, final, process_gone, wait_until
from tests.weight_swap_support import hf_greedy

pytestmark = pytest.mark.ray

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [[5, 9, 13, 17], list(range(3, 83)), [100, 200, 300, 400, 500], [42] * 9]
"""The second is longer than max_num_batched_tokens (32): its prefill takes three chunks."""
DEATH_BOUND = 10.0
"""Seconds from an actor's death to the end of every stream."""

in_module_loop = pytest.mark.asyncio(loop_scope="module")


def ray_config(path: Path) -> EngineConfig:
    parallel = {"distributed_executor_backend": "ray", "tensor_parallel_size": 2}
    return engine_config(path, parallel=parallel, cache={"num_blocks": 128}, scheduler={"max_num_batched_tokens": 32})


def executor_of(engine: AsyncEngine) -> RayExecutor:
    assert isinstance(engine.executor, RayExecutor)
    return engine.executor


async def greedy(engine: AsyncEngine, prompts: Sequence[list[int]] = PROMPTS) -> list[list[int]]:
    """Greedy tokens of every prompt, all generated concurrently."""
    outs = await asyncio.gather(*(final(engine, p, GREEDY) for p in prompts))
    return [list(out.token_ids) for out in outs]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[ModuleType]:
    """A local Ray instance for the module's engines: 4 logical CPUs, a bundle for each rank of two engines
    (logical CPUs only gate placement; a rank of a 2-rank CPU engine runs on half the host's cores)."""
    ray = pytest.importorskip("ray", reason='needs the ray extra: pip install "aioengine[ray]"')
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ray_engine(local_ray: ModuleType, llama_ckpt: Path) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(ray_config(llama_ckpt)) as engine:
        yield engine


# ---- without Ray (first: no Ray instance runs in this process yet) --------------------------------------
async def test_without_ray_installed_the_start_is_refused_naming_the_extra(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    engine = AsyncEngine(ray_config(llama_ckpt))
    with pytest.raises(ConfigurationError, match=r'pip install "aioengine\[ray\]"'):
        await engine.start()
    assert engine.executor is None
    await engine.shutdown()


# ---- the actors and the calls into them -----------------------------------------------------------------
@in_module_loop
async def test_each_rank_runs_a_callable_in_a_ray_actor_of_its_own(ray_engine: AsyncEngine) -> None:
    pids = await ray_engine.collective_rpc(lambda worker: os.getpid())
    assert pids == executor_of(ray_engine).pids
    assert len(set(pids)) == 2
    assert os.getpid() not in pids


@in_module_loop
async def test_unique_reply_rank_returns_that_rank_s_result_alone(ray_engine: AsyncEngine) -> None:
    assert await ray_engine.collective_rpc(lambda worker: worker.rank, unique_reply_rank=1) == 1
    info = await ray_engine.collective_rpc("get_model_info", unique_reply_rank=0)
    assert isinstance(info, ModelInfo)


@in_module_loop
async def test_the_ranks_hold_a_cpu_each_in_a_strict_pack_placement_group(
    local_ray: ModuleType, ray_engine: AsyncEngine
) -> None:
    table = local_ray.util.placement_group_table(executor_of(ray_engine).placement_group)
    assert table["strategy"] == "STRICT_PACK"
    assert list(table["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]


@in_module_loop
async def test_an_exception_of_one_rank_arrives_with_its_type_and_message(ray_engine: AsyncEngine) -> None:
    def refuse(worker: Any) -> None:
        if worker.rank == 1:
            raise CheckpointError(f"rank {worker.rank} refuses tensor 'lm_head.weight'")

    with pytest.raises(CheckpointError, match=r"rank 1 refuses tensor 'lm_head\.weight'") as caught:
        await ray_engine.collective_rpc(refuse)
    assert any("raised in worker rank 1" in note for note in caught.value.__notes__)


@in_module_loop
async def test_greedy_tokens_over_two_ray_actors_equal_hf_transformers(
    ray_engine: AsyncEngine, llama_ckpt: Path
) -> None:
    assert await greedy(ray_engine) == hf_greedy(llama_ckpt, PROMPTS, NEW_TOKENS)


@in_module_loop
async def test_sleep_level_1_and_wake_give_the_same_greedy_tokens(ray_engine: AsyncEngine) -> None:
    before = await greedy(ray_engine)
    await ray_engine.sleep(level=1)
    assert ray_engine.stats().sleeping
    await ray_engine.wake_up()
    assert not ray_engine.stats().sleeping
    assert await greedy(ray_engine) == before


@in_module_loop
async def test_run_aside_runs_while_a_call_holds_the_step_lane(ray_engine: AsyncEngine, tmp_path: Path) -> None:
    def hold_the_worker(worker: Any) -> None:
        (tmp_path / f"inside-{worker.rank}").touch()
        deadline = time.monotonic() + TIMEOUT
        while not (tmp_path / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.005)

    held = asyncio.ensure_future(ray_engine.collective_rpc(hold_the_worker))
    try:
        await wait_until(lambda: len(list(tmp_path.glob("inside-*"))) == 2, "inside the call on both ranks")
        infos = await executor_of(ray_engine).run_aside("get_model_info")
        assert [type(info) for info in infos] == [ModelInfo, ModelInfo]
        assert not held.done(), "run_aside waited for the step lane"
    finally:
        (tmp_path / "release").touch()
        await held


# ---- an actor that dies ---------------------------------------------------------------------------------
@dataclass
class Killed:
    engine: AsyncEngine
    pid: int
    results: list[BaseException | None]
    seconds: float
    """From the kill to the end of the last stream."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def killed(local_ray: ModuleType, llama_ckpt: Path) -> AsyncIterator[Killed]:
    """An engine whose rank-1 actor was killed (SIGKILL) while every prompt was generating."""
    engine = AsyncEngine(ray_config(llama_ckpt))
    await engine.start()
    try:
        pid = executor_of(engine).pids[1]
        assert pid is not None
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
async def test_killing_an_actor_ends_every_stream_with_an_error_within_the_bound(killed: Killed) -> None:
    assert all(isinstance(r, RequestAbortedError) for r in killed.results), killed.results
    assert killed.seconds < DEATH_BOUND


@in_module_loop
async def test_the_stream_error_names_the_killed_rank_and_its_pid(killed: Killed) -> None:
    assert f"worker rank 1 (Ray actor, pid {killed.pid} on " in str(killed.results[0])


@in_module_loop
async def test_a_killed_actor_leaves_the_engine_dead_and_every_later_call_fails_naming_the_rank(
    killed: Killed,
) -> None:
    assert killed.engine.stats().dead
    with pytest.raises(EngineDeadError):
        await final(killed.engine, [1, 2, 3], GREEDY)
    with pytest.raises(EngineDeadError, match="worker rank 1"):
        await executor_of(killed.engine).collective_rpc("check_health")


@in_module_loop
async def test_shutdown_kills_the_other_actor_and_removes_the_placement_group_and_leaves_ray_running(
    local_ray: ModuleType, killed: Killed, ray_engine: AsyncEngine
) -> None:
    executor = executor_of(killed.engine)
    await asyncio.wait_for(killed.engine.shutdown(), TIMEOUT)
    for pid in executor.pids:
        assert pid is not None
        await wait_until(lambda pid=pid: process_gone(pid), f"rid of actor process {pid}")
    assert local_ray.util.placement_group_table(executor.placement_group)["state"] == "REMOVED"
    assert local_ray.is_initialized(), "an engine shut down the Ray instance it did not start"
    assert await ray_engine.collective_rpc("get_cache_block_size_bytes", unique_reply_rank=0) > 0
