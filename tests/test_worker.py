"""The worker layer of the seeds: collective_rpc, extensions, padded decode buckets, faults, profiling."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from aioengine import AsyncEngine, SamplingParams
from aioengine.errors import AIOEngineError, EngineDeadError
from aioengine.worker.cpu_worker import CPUWorker
from aioengine.worker.graphs import PaddedDecodeRunner, default_capture_sizes
from tests.conftest import engine_config
from tests.helpers import final

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
EXT = "tests.worker_extensions.EchoExtension"


async def _collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return (await final(engine, prompt, params)).token_ids


# ---- collective_rpc --------------------------------------------------------------------------------
async def test_collective_rpc_by_name_returns_one_result_per_rank(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt, parallel={"worker_extension_cls": EXT}) as engine:
        assert await engine.collective_rpc("echo_rank", args=("!",)) == ["rank0!"]
        assert await engine.collective_rpc("echo_rank", kwargs={"suffix": "?"}, unique_reply_rank=0) == "rank0?"


async def test_collective_rpc_with_a_callable_gets_the_worker(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt) as engine:
        kinds = await engine.collective_rpc(lambda worker, n: (type(worker).__name__, worker.rank + n), args=(10,))
        assert kinds == [("CPUWorker", 10)]


async def test_collective_rpc_timeout_names_the_method_and_engine_keeps_serving(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt, parallel={"worker_extension_cls": EXT}) as engine:
        with pytest.raises(TimeoutError, match="sleep_for"):
            await engine.collective_rpc("sleep_for", args=(1.0,), timeout=0.1)
        assert len(await _collect(engine, [5, 6, 7])) == GREEDY.max_tokens


async def test_collective_rpc_exception_surfaces_and_engine_keeps_serving(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt, parallel={"worker_extension_cls": EXT}) as engine:
        with pytest.raises(ValueError, match="bad thing 42"):
            await engine.collective_rpc("raise_value_error", args=("bad thing 42",))
        assert len(await _collect(engine, [5, 6, 7])) == GREEDY.max_tokens
        await engine.check_health()


async def test_collective_rpc_runs_in_order_with_steps_on_the_worker_thread(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt) as engine:
        gen = asyncio.create_task(_collect(engine, [5, 6, 7]))
        threads = set()
        for _ in range(5):
            threads.update(await engine.collective_rpc(lambda w: __import__("threading").current_thread().name))
            await asyncio.sleep(0)
        await gen
        assert threads == {"aioengine-worker-0_0"}


# ---- extensions --------------------------------------------------------------------------------------
async def test_extension_clash_fails_at_startup_naming_the_attribute(make_engine, llama_ckpt: Path) -> None:
    engine = make_engine(llama_ckpt, parallel={"worker_extension_cls": "tests.worker_extensions.ClashingExtension"})
    with pytest.raises(AIOEngineError, match="load_model"):
        await engine.start()
    await engine.shutdown()


async def test_extension_clash_in_a_composed_mixin_is_found_too(make_engine, llama_ckpt: Path) -> None:
    qualname = "tests.worker_extensions.ComposedClashingExtension"
    engine = make_engine(llama_ckpt, parallel={"worker_extension_cls": qualname})
    with pytest.raises(AIOEngineError, match="load_model"):
        await engine.start()
    await engine.shutdown()


async def test_two_engines_with_different_extensions_stay_separate(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt, parallel={"worker_extension_cls": EXT}) as a, \
            make_engine(llama_ckpt, parallel={"worker_extension_cls": "tests.worker_extensions.OtherExtension"}) as b:
        assert await a.collective_rpc("echo_rank") == ["rank0"]
        assert await b.collective_rpc("other_method") == ["other"]
        with pytest.raises(AttributeError):
            await a.collective_rpc("other_method")
        with pytest.raises(AttributeError):
            await b.collective_rpc("echo_rank")
    assert not hasattr(CPUWorker, "echo_rank") and not hasattr(CPUWorker, "other_method")


async def test_worker_cls_override_can_act_between_forward_and_sampling(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt, parallel={"worker_cls": "tests.worker_extensions.ForcedTokenWorker"}) as engine:
        assert await _collect(engine, [5, 6, 7]) == [7] * GREEDY.max_tokens


# ---- padded decode buckets -------------------------------------------------------------------------
def test_default_capture_sizes_cover_up_to_max_num_seqs() -> None:
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(1) == [1]


def _decode_runner(ckpt: Path, sizes: list[int]) -> tuple[PaddedDecodeRunner, list[torch.Tensor]]:
    from aioengine.messages import KVCacheConfig

    cfg = engine_config(ckpt, compile={"enforce_eager": True})
    worker = CPUWorker(cfg)
    worker.init_device()
    worker.load_model()
    worker.initialize_from_config(KVCacheConfig(num_cache_blocks=16, block_size=16))
    runner = worker.model_runner
    assert runner is not None and runner.model is not None and runner.cache_engine is not None
    caches = runner.cache_engine.device_cache
    for c in caches:
        c.normal_()
    return PaddedDecodeRunner(runner.model, caches, sizes, 16, 4, torch.device("cpu"), use_graphs=False), caches


def test_bucket_is_the_smallest_size_that_holds_the_batch(llama_ckpt: Path) -> None:
    runner, _ = _decode_runner(llama_ckpt, [1, 2, 4, 8])
    assert [runner.bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_padded_rows_write_only_the_null_block(llama_ckpt: Path) -> None:
    runner, caches = _decode_runner(llama_ckpt, [8])
    before = [c.clone() for c in caches]
    tables = torch.tensor([[3, 4], [7, 0], [9, 0]])
    positions = torch.tensor([17, 2, 0])
    logits = runner.run(torch.tensor([11, 12, 13]), positions, tables)
    assert logits.shape[0] == 3
    written = {int(tables[i, p // 16]) * 16 + int(p) % 16 for i, p in enumerate(positions)}
    for old, new in zip(before, caches):
        changed = (old != new).flatten(3).any(-1).any(0).flatten()  # per slot: [blocks * block_size]
        slots = set(torch.nonzero(changed).flatten().tolist())
        real = {s for s in slots if s >= 16}  # block 0 is the null block
        assert real == written


async def test_padded_buckets_give_the_same_tokens_as_enforce_eager(make_engine, llama_ckpt: Path) -> None:
    prompts = [[int(t) for t in torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 17, 40, 5, 66)]  # fmt: skip
    results = []
    for compile_cfg in ({"enforce_eager": True}, {"enforce_eager": False, "cuda_graph_sizes": [1, 2, 4, 8]}):
        async with make_engine(llama_ckpt, compile=compile_cfg) as engine:
            padded = engine.executor.wrappers[0].worker.model_runner.decode_runner  # type: ignore[union-attr]
            assert (padded is None) == compile_cfg["enforce_eager"]
            results.append(await asyncio.gather(*(_collect(engine, p) for p in prompts)))
    assert results[0] == results[1]


# ---- faults and health ---------------------------------------------------------------------------
async def test_worker_fault_mid_generation_ends_every_request_with_an_error(make_engine, llama_ckpt: Path) -> None:
    engine = make_engine(llama_ckpt)
    await engine.start()
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    tasks = [asyncio.create_task(_collect(engine, [5 + i, 6, 7], params)) for i in range(6)]
    await asyncio.sleep(0.05)

    def boom(*args: object) -> None:
        raise RuntimeError("injected device fault")

    await engine.collective_rpc(lambda w: setattr(w.model_runner, "execute_model", boom))
    started = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
    assert time.monotonic() - started < 30
    assert all(isinstance(r, EngineDeadError) and "injected device fault" in str(r) for r in results), results
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await _collect(engine, [1, 2, 3])
    await asyncio.wait_for(engine.shutdown(), timeout=30)
    await engine.shutdown()


async def test_check_health_passes_on_a_serving_engine(llama_engine: AsyncEngine) -> None:
    await llama_engine.check_health()


# ---- profiling ---------------------------------------------------------------------------------------
async def test_profile_without_a_dir_says_which_option_to_set(llama_engine: AsyncEngine) -> None:
    with pytest.raises(RuntimeError, match="profiler.dir"):
        await llama_engine.start_profile()


async def test_profile_writes_a_trace(make_engine, llama_ckpt: Path, tmp_path: Path) -> None:
    async with make_engine(llama_ckpt, profiler={"dir": str(tmp_path)}) as engine:
        await engine.start_profile()
        await _collect(engine, [5, 6, 7])
        assert await engine.stop_profile() == [str(tmp_path)]
    assert any(p.name.endswith(".json") or ".pt.trace" in p.name for p in tmp_path.iterdir())


# ---- KV cache sizing on CPU ------------------------------------------------------------------------
async def test_cpu_kv_cache_takes_the_configured_bytes(make_engine, llama_ckpt: Path) -> None:
    budget = 3 << 20
    async with make_engine(llama_ckpt, cache={"num_blocks": None, "kv_cache_memory_bytes": budget}) as engine:
        block_bytes = await engine.collective_rpc("get_cache_block_size_bytes", unique_reply_rank=0)
        assert engine.stats().kv_blocks_total == budget // block_bytes - 1  # one block is the null block


async def test_cpu_kv_cache_larger_than_free_memory_fails_at_start_naming_the_option(make_engine, llama_ckpt: Path) -> None:
    engine = make_engine(llama_ckpt, cache={"num_blocks": None, "kv_cache_memory_bytes": 1 << 50})
    with pytest.raises(AIOEngineError, match="kv_cache_memory_bytes"):
        await engine.start()
    await engine.shutdown()
