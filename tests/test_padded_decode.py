"""Decode steps padded to fixed batch-size buckets (``worker.graphs.PaddedDecodeRunner``): the buckets, the null
block that padded rows write, and the same tokens padded or not as eager."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from aioengine import AsyncEngine, SamplingParams
from aioengine.messages import ScheduledRequest
from aioengine.worker.cpu_worker import CPUWorker
from aioengine.worker.graphs import PaddedDecodeRunner, default_capture_sizes
from aioengine.worker.step_inputs import DecodeBatch, padded_decode_inputs
from tests.conftest import engine_config
from tests.helpers import final

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


async def _collect(engine: AsyncEngine, prompt: list[int]) -> list[int]:
    return (await final(engine, prompt, GREEDY)).token_ids


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
    decode = PaddedDecodeRunner(runner.model, caches, sizes, 16, 4, torch.device("cpu"), use_graphs=False)
    decode.pad = True  # eager runs at the batch's own size unless told to pad
    return decode, caches


def test_bucket_is_the_smallest_size_that_holds_the_batch(llama_ckpt: Path) -> None:
    runner, _ = _decode_runner(llama_ckpt, [1, 2, 4, 8])
    assert [runner.bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def _batch(tokens: list[int], positions: list[int], tables: list[list[int]]) -> DecodeBatch:
    reqs = [
        ScheduledRequest(f"r{i}", [t], p, blocks, GREEDY)
        for i, (t, p, blocks) in enumerate(zip(tokens, positions, tables, strict=True))
    ]
    return padded_decode_inputs(reqs, torch.device("cpu"), decode_kernel=None, block_size=16)


def test_padded_rows_write_only_the_null_block(llama_ckpt: Path) -> None:
    runner, caches = _decode_runner(llama_ckpt, [8])
    before = [c.clone() for c in caches]
    tables, positions = [[3, 4], [7], [9]], [17, 2, 0]
    logits = runner.run(_batch([11, 12, 13], positions, tables))
    assert logits.shape[0] == 3
    written = {tables[i][p // 16] * 16 + p % 16 for i, p in enumerate(positions)}
    for old, new in zip(before, caches, strict=True):
        changed = (old != new).flatten(3).any(-1).any(0).flatten()  # per slot: [blocks * block_size]
        slots = set(torch.nonzero(changed).flatten().tolist())
        real = {s for s in slots if s >= 16}  # block 0 is the null block
        assert real == written


def test_eager_decode_without_padding_runs_the_batch_at_its_own_size_with_the_same_logits(llama_ckpt: Path) -> None:
    runner, _ = _decode_runner(llama_ckpt, [8])
    rows: list[int] = []
    final_hidden = runner.model.final_hidden

    def counting(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(input_ids.shape[0])
        return final_hidden(input_ids, *args)  # type: ignore[arg-type]

    runner.model.final_hidden = counting  # type: ignore[method-assign]
    batch = _batch([11, 12, 13], [17, 2, 0], [[3, 4], [7], [9]])
    padded = runner.run(batch)
    runner.pad = False
    own = runner.run(batch)
    assert rows == [8, 3]
    torch.testing.assert_close(own, padded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pad", [True, False])
async def test_padded_buckets_give_the_same_tokens_as_enforce_eager(make_engine, llama_ckpt: Path, pad: bool) -> None:
    prompts = [[int(t) for t in torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (3, 17, 40, 5, 66)]  # fmt: skip
    results = []
    for compile_cfg in ({"enforce_eager": True}, {"enforce_eager": False, "cuda_graph_sizes": [1, 2, 4, 8]}):
        async with make_engine(llama_ckpt, compile=compile_cfg) as engine:
            eager = await engine.collective_rpc(lambda w: w.model_runner.decode_runner is None, unique_reply_rank=0)
            assert eager == compile_cfg["enforce_eager"]
            if not eager:  # CPU runs unpadded unless told: both ways must give the same tokens
                await engine.collective_rpc(lambda w: setattr(w.model_runner.decode_runner, "pad", pad))
            results.append(await asyncio.gather(*(_collect(engine, p) for p in prompts)))
    assert results[0] == results[1]
