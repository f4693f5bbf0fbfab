"""EnginePool: several models on one device under a memory budget."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aioengine import AsyncEngine, EnginePool, RequestOutput, SamplingParams
from aioengine.errors import ConfigurationError, InvalidRequestError
from tests.conftest import engine_config
from tests.helpers import last_output

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [42, 43], [9] * 30, [11, 12, 13, 14, 15]]


async def _final(stream: AsyncIterator[RequestOutput]) -> list[int]:
    return (await last_output(stream)).token_ids


async def _reference(path: Path) -> list[list[int]]:
    async with AsyncEngine(engine_config(path, cache={"num_blocks": 256})) as engine:
        return [await _final(engine.generate(p, GREEDY)) for p in PROMPTS]


def _pool(llama: Path, qwen2: Path, **kwargs: object) -> EnginePool:
    configs = {"llama": engine_config(llama, cache={"num_blocks": 256}),
               "qwen2": engine_config(qwen2, cache={"num_blocks": 256})}  # fmt: skip
    return EnginePool(configs, **kwargs)  # type: ignore[arg-type]


def _awake_engines(pool: EnginePool) -> int:
    # Ask the engines themselves, not the pool's bookkeeping.
    return sum(1 for t in pool.tenants.values() if not t.engine.stats().sleeping)


async def test_interleaved_requests_to_two_models_all_finish_and_never_both_awake(
    llama_ckpt: Path, qwen2_ckpt: Path
) -> None:
    refs = {"llama": await _reference(llama_ckpt), "qwen2": await _reference(qwen2_ckpt)}
    pool = _pool(llama_ckpt, qwen2_ckpt)
    async with pool:
        footprint = max(pool.stats().footprints.values())
        assert footprint > 0
        pool.budget_bytes = int(footprint * 1.5)  # room for one model, not two
        peak = 0
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, _awake_engines(pool))
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("llama", "qwen2")]
        results = await asyncio.gather(*(_final(pool.generate(name, PROMPTS[i], GREEDY)) for name, i in jobs))
        stop.set()
        await watcher
        for (name, i), tokens in zip(jobs, results):
            assert tokens == refs[name][i], (name, i)
        assert peak == 1
        assert pool.stats().switches >= 2


async def test_max_awake_limits_awake_engines_without_a_budget(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    async with _pool(llama_ckpt, qwen2_ckpt, max_awake=1) as pool:
        await _final(pool.generate("llama", [1, 2, 3], GREEDY))
        assert pool.awake_models() == ["llama"]
        await _final(pool.generate("qwen2", [1, 2, 3], GREEDY))
        assert pool.awake_models() == ["qwen2"]
        assert _awake_engines(pool) == 1


async def test_unbounded_pool_keeps_both_awake(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    async with _pool(llama_ckpt, qwen2_ckpt) as pool:
        await _final(pool.generate("llama", [1, 2, 3], GREEDY))
        await _final(pool.generate("qwen2", [1, 2, 3], GREEDY))
        assert sorted(pool.awake_models()) == ["llama", "qwen2"]


async def test_idle_engine_goes_to_sleep_by_itself(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    async with _pool(llama_ckpt, qwen2_ckpt, idle_timeout=0.1) as pool:
        await _final(pool.generate("llama", [1, 2, 3], GREEDY))
        for _ in range(200):
            if not pool.awake_models():
                break
            await asyncio.sleep(0.01)
        assert pool.awake_models() == []
        assert await pool.tenants["llama"].engine.is_sleeping()


async def test_unknown_model_name_is_refused_naming_the_known_ones(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    async with _pool(llama_ckpt, qwen2_ckpt) as pool:
        with pytest.raises(InvalidRequestError, match="llama, qwen2"):
            await _final(pool.generate("gpt", [1, 2], GREEDY))


async def test_a_model_larger_than_the_budget_is_refused_at_start(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    pool = _pool(llama_ckpt, qwen2_ckpt, budget_bytes=1024)
    with pytest.raises(ConfigurationError, match="budget"):
        await pool.start()
    await pool.shutdown()
