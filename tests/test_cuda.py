"""CUDA-only checks (marked `cuda`, skipped without a device): graphs, memory sizing, parity on GPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from aioengine import AsyncEngine, SamplingParams
from tests.conftest import engine_config
from tests.helpers import final, hf_generate

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _cuda_config(path: Path, **sections: object):
    return engine_config(path, device={"device": "cuda"}, **sections)  # type: ignore[arg-type]


async def _run(engine: AsyncEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in await asyncio.gather(*(final(engine, p, GREEDY) for p in prompts))]


def _prompts(n: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 1000, (int(k),), generator=g).tolist() for k in torch.randint(1, 150, (n,), generator=g)]


async def test_cuda_graphs_are_captured_and_match_hf(llama_ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = _prompts()
    hf = AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32).cuda().eval()
    refs = hf_generate(hf, prompts, GREEDY.max_tokens)
    async with AsyncEngine(_cuda_config(llama_ckpt)) as engine:
        captured = await engine.collective_rpc(
            lambda w: w.model_runner.decode_runner is not None and bool(w.model_runner.decode_runner.graphs),
            unique_reply_rank=0,
        )
        assert captured
        assert await _run(engine, prompts) == refs


async def test_graph_replay_matches_eager_on_cuda(llama_ckpt: Path) -> None:
    prompts = _prompts()
    async with AsyncEngine(_cuda_config(llama_ckpt, compile={"enforce_eager": True})) as eager:
        expected = await _run(eager, prompts)
    async with AsyncEngine(_cuda_config(llama_ckpt)) as graphs:
        assert await _run(graphs, prompts) == expected


async def test_decode_windows_on_captured_graphs_give_single_steps_tokens(llama_ckpt: Path) -> None:
    # A window's later steps move the captured batch on with tensor ops on the device (no row groups).
    prompts = _prompts()
    async with AsyncEngine(_cuda_config(llama_ckpt, scheduler={"decode_steps": 1})) as single:
        expected = await _run(single, prompts)
        single_steps = single.core.num_steps
    windows = {"decode_steps": 4, "decode_window_s": 10.0}
    async with AsyncEngine(_cuda_config(llama_ckpt, scheduler=windows)) as windowed:
        assert await _run(windowed, prompts) == expected
        assert windowed.core.num_steps < single_steps


async def test_kv_cache_is_sized_from_device_memory(llama_ckpt: Path) -> None:
    config = engine_config(llama_ckpt, device={"device": "cuda"}, cache={"num_blocks": None, "memory_utilization": 0.3})
    async with AsyncEngine(config) as engine:
        block_bytes = await engine.collective_rpc("get_cache_block_size_bytes", unique_reply_rank=0)
        total = torch.cuda.mem_get_info()[1]
        assert 0 < (engine.stats().kv_blocks_total + 1) * block_bytes <= 0.3 * total


async def test_shutdown_gives_device_memory_back(llama_ckpt: Path) -> None:
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    engine = AsyncEngine(_cuda_config(llama_ckpt, cache={"num_blocks": 4096}))
    await engine.start()
    assert torch.cuda.mem_get_info()[0] < free_before
    await engine.shutdown()
    assert torch.cuda.mem_get_info()[0] >= free_before - (64 << 20)


@pytest.mark.parametrize("level", [1, 2])
async def test_torch_memory_saver_sleep_and_wake_keep_greedy_outputs(llama_ckpt: Path, level: int) -> None:
    pytest.importorskip("torch_memory_saver")
    prompts = _prompts(6)
    async with AsyncEngine(_cuda_config(llama_ckpt, sleep={"backend": "torch_memory_saver"})) as engine:
        backend = await engine.collective_rpc(lambda w: type(w.sleep_backend).__name__, unique_reply_rank=0)
        assert backend == "TorchMemorySaverBackend"
        before = await _run(engine, prompts)
        report = await engine.sleep(level=level)
        assert report.freed_bytes.weights > 0 and report.freed_bytes.kv_cache > 0
        await engine.wake_up()
        if level == 2:
            await engine.reload_weights()
        assert await _run(engine, prompts) == before
