"""Tensor parallelism over worker processes (``distributed_executor_backend = "mp"``, gloo on CPU).

Every rank holds a shard of the model (attention by heads, the MLP by intermediate rows, embedding and LM
head by vocabulary rows); the greedy tokens must still be HF transformers' on the same checkpoint, with
chunked prefill and preemption, for each member of the Llama family. The llama engine is shared by the
module (its own event loop) and every test leaves it as it found it. A rank's faults (killed, hung) are in
test_tensor_parallel_faults.py.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from aioengine import AsyncEngine, SamplingParams
from aioengine.config import EngineConfig
from aioengine.errors import CheckpointError, UnsupportedModelError
from aioengine.model.loader import checkpoint_files
from aioengine.model.packing import dense_parameters
from aioengine.testing import build_checkpoint
from aioengine.worker.weights import tensor_source
from plugins.weight_sync import broadcast_weights, free_port, leave_group, trainer_group, weight_metadata
from tests.conftest import engine_config
from tests.helpers import TIMEOUT, final
from tests.weight_swap_support import hf_greedy

TP = 2
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPTS = [[5, 9, 13, 17], list(range(3, 83)), [100, 200, 300, 400, 500] * 9, list(range(900, 800, -1))]
"""4 to 100 tokens: with MAX_BATCHED_TOKENS the longer ones prefill in chunks."""
MAX_BATCHED_TOKENS = 32
NUM_BLOCKS = 10
"""Blocks of 16 tokens (9 usable, 144 tokens): each request fits alone, all four together do not (preemption)."""

in_module_loop = pytest.mark.asyncio(loop_scope="module")


def tp_config(path: Path, tp: int = TP, **sections: Any) -> EngineConfig:
    parallel = {"distributed_executor_backend": "mp", "tensor_parallel_size": tp, **sections.pop("parallel", {})}
    cache = {"num_blocks": NUM_BLOCKS, **sections.pop("cache", {})}
    scheduler = {"max_num_batched_tokens": MAX_BATCHED_TOKENS, **sections.pop("scheduler", {})}
    return engine_config(path, parallel=parallel, cache=cache, scheduler=scheduler, **sections)


async def greedy(engine: AsyncEngine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """Every prompt at once, so they batch, chunk and preempt each other."""
    outs = await asyncio.gather(*(final(engine, p, GREEDY) for p in prompts))
    return [list(out.token_ids) for out in outs]


async def parity(path: Path) -> tuple[list[list[int]], list[list[int]], list[list[int]], int]:
    """(TP=2 tokens, TP=1 tokens, HF tokens, preemptions at TP=2) on the same checkpoint and prompts."""
    async with AsyncEngine(tp_config(path)) as engine:
        sharded = await greedy(engine)
        preemptions = engine.stats().num_preemptions
    async with AsyncEngine(tp_config(path, tp=1, parallel={"distributed_executor_backend": "thread"})) as engine:
        single = await greedy(engine)
    return sharded, single, hf_greedy(path, PROMPTS, NEW_TOKENS), preemptions


# ---- the shared llama engine --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def expected(llama_ckpt: Path, ckpt_b: Path) -> dict[str, list[list[int]]]:
    return {"A": hf_greedy(llama_ckpt, PROMPTS, NEW_TOKENS), "B": hf_greedy(ckpt_b, PROMPTS, NEW_TOKENS)}


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(llama_ckpt: Path, traces: Path) -> AsyncIterator[AsyncEngine]:
    config = tp_config(
        llama_ckpt,
        parallel={"worker_extension_cls": "plugins.weight_sync.WeightSyncExtension"},
        profiler={"dir": str(traces)},
    )
    async with AsyncEngine(config) as engine:
        yield engine


@in_module_loop
async def test_llama_at_tp2_gives_hfs_greedy_tokens_with_chunked_prefill_and_preemption(
    engine: AsyncEngine, expected: dict[str, list[list[int]]]
) -> None:
    before = engine.stats().num_preemptions
    assert await greedy(engine) == expected["A"]
    assert engine.stats().num_preemptions > before, "the cache is meant to be too small for all four at once"


@in_module_loop
async def test_each_rank_holds_its_shard_of_every_sharded_weight(engine: AsyncEngine, llama_ckpt: Path) -> None:
    def shapes(worker: Any) -> tuple[int, int, dict[str, tuple[int, ...]]]:
        model = worker.model_runner.model
        return worker.tp.rank, worker.tp.size, {n: tuple(p.shape) for n, p in model.named_parameters()}

    (rank0, size, got), (rank1, _, got1) = await engine.collective_rpc(shapes)
    assert (rank0, rank1, size) == (0, 1, TP)
    assert got == got1
    full = load_file(llama_ckpt / "model.safetensors")
    hidden, heads, kv_heads, head_dim = 64, 4, 2, 16  # build_checkpoint's defaults
    assert got["model.embed_tokens.weight"] == (full["model.embed_tokens.weight"].shape[0] // TP, hidden)
    assert got["model.layers.0.self_attn.qkv_proj.weight"] == ((heads + 2 * kv_heads) * head_dim // TP, hidden)
    assert got["model.layers.0.self_attn.o_proj.weight"] == (hidden, heads * head_dim // TP)
    assert got["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 128 // TP, hidden)
    assert got["model.layers.0.mlp.down_proj.weight"] == (hidden, 128 // TP)
    assert got["model.norm.weight"] == (hidden,)  # replicated


@in_module_loop
async def test_collective_rpc_reaches_every_rank_and_unique_reply_rank_picks_one(engine: AsyncEngine) -> None:
    assert await engine.collective_rpc(lambda worker: worker.rank) == list(range(TP))
    assert await engine.collective_rpc(lambda worker: worker.rank, unique_reply_rank=1) == 1


@in_module_loop
async def test_every_rank_runs_the_cpu_kernels(engine: AsyncEngine, kernel: Any) -> None:
    def kernels_on(worker: Any) -> tuple[bool, bool]:
        runner = worker.model_runner
        return runner.decode_kernel is not None, runner.model.model.norm.kernels is not None

    assert await engine.collective_rpc(kernels_on) == [(True, True)] * TP


@in_module_loop
async def test_profiling_writes_a_trace_per_rank(
    engine: AsyncEngine, traces: Path, expected: dict[str, list[list[int]]]
) -> None:
    await engine.start_profile()
    assert await greedy(engine, PROMPTS[:1]) == expected["A"][:1]
    assert await engine.stop_profile() == [str(traces)] * TP
    names = sorted(p.name for p in traces.iterdir())
    assert [sum(f"rank{r}" in n for n in names) for r in range(TP)] == [1] * TP, names


def expected_bytes(path: Path, rank_share: dict[str, int]) -> int:
    """Bytes a rank must read: 1/TP of each sharded tensor (``rank_share``: name -> divisor), replicated ones whole."""
    total = 0
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                view = f.get_slice(name)
                numel = 1
                for d in view.get_shape():
                    numel *= d
                total += numel * 4 // rank_share.get(name.rsplit(".", 2)[-2], 1)
    return total


@in_module_loop
async def test_sharded_loading_reads_only_each_ranks_slice(engine: AsyncEngine, llama_ckpt: Path) -> None:
    sharded = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")
    read = await engine.collective_rpc(lambda worker: worker.model_runner.bytes_loaded)
    whole = expected_bytes(llama_ckpt, {})
    assert read == [expected_bytes(llama_ckpt, dict.fromkeys(sharded, TP))] * TP
    assert all(r < 0.6 * whole for r in read), (read, whole)  # only the norms are read twice


@in_module_loop
@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_and_wake_free_and_restore_every_ranks_shard(
    engine: AsyncEngine, expected: dict[str, list[list[int]]], level: int
) -> None:
    caches = await engine.collective_rpc(lambda worker: worker.model_runner.cache_engine.nbytes)
    shards = await engine.collective_rpc(lambda worker: sum(p.nbytes for p in worker.model_runner.model.parameters()))
    report = await engine.sleep(level=level)
    assert report.freed_bytes.kv_cache == sum(caches)  # every rank freed its cache
    # On CPU level 1 keeps the weights where they are (host memory); level 2 discards every rank's shard.
    assert report.freed_bytes.weights == (sum(shards) if level == 2 else 0)
    asleep = ["kv_cache", "weights"] if level == 2 else ["kv_cache"]
    assert await engine.collective_rpc("is_sleeping") == [asleep] * TP
    await engine.wake_up()
    if level == 2:
        await engine.reload_weights()  # discarded on every rank: each reads its slices again
    assert await greedy(engine) == expected["A"]


@in_module_loop
async def test_update_weights_swaps_every_ranks_shard_and_back(
    engine: AsyncEngine, ckpt_b: Path, llama_ckpt: Path, expected: dict[str, list[list[int]]]
) -> None:
    await engine.update_weights(ckpt_b)
    assert await greedy(engine) == expected["B"]
    await engine.update_weights(llama_ckpt, stage=True)  # staged: each rank keeps only its slices
    assert await greedy(engine) == expected["A"]


def checksums(worker: Any) -> tuple[int, dict[str, float]]:
    model = worker.model_runner.model
    return worker.weights_version, {n: float(p.double().sum()) for n, p in dense_parameters(model).items()}


@in_module_loop
async def test_a_bad_source_changes_nothing_on_any_rank(
    engine: AsyncEngine, ckpt_b: Path, expected: dict[str, list[list[int]]]
) -> None:
    before = await engine.collective_rpc(checksums)
    bad = load_file(ckpt_b / "model.safetensors")
    bad["model.layers.1.mlp.up_proj.weight"] = bad["model.layers.1.mlp.up_proj.weight"][:, :-1]
    with pytest.raises(CheckpointError, match=re.escape("up_proj.weight' has shape")):
        await engine.update_weights(bad)
    assert await engine.collective_rpc(checksums) == before
    assert await greedy(engine) == expected["A"]


@in_module_loop
async def test_a_source_one_rank_refuses_is_written_by_no_rank(
    engine: AsyncEngine, ckpt_b: Path, expected: dict[str, list[list[int]]]
) -> None:
    good = load_file(ckpt_b / "model.safetensors")
    bad = {**good, "model.norm.weight": good["model.norm.weight"][:-1]}

    def write_rank_dependent(worker: Any, good: dict[str, torch.Tensor], bad: dict[str, torch.Tensor]) -> Any:
        # Rank 1 is handed a source its check refuses; rank 0 one that would pass: the vote stops rank 0 too.
        source = tensor_source(list((bad if worker.rank == 1 else good).items()))
        return worker.write_weights(source, partial=False)

    before = await engine.collective_rpc(checksums)
    with pytest.raises(CheckpointError) as raised:
        await engine.collective_rpc(write_rank_dependent, args=(good, bad))
    assert "model.norm.weight" in str(raised.value) or "another tensor-parallel rank refused" in str(raised.value)
    assert await engine.collective_rpc(checksums) == before
    assert await greedy(engine) == expected["A"]


@in_module_loop
async def test_weights_a_trainer_broadcasts_reach_every_rank_as_its_slices(
    engine: AsyncEngine, ckpt_b: Path, llama_ckpt: Path, expected: dict[str, list[list[int]]]
) -> None:
    tensors = load_file(ckpt_b / "model.safetensors")
    port, errors = free_port(), []

    def trainer() -> None:  # a thread is enough: the group is private, nothing global is touched
        try:
            _store, group = trainer_group(port, world_size=1 + TP, timeout=timedelta(seconds=30))
            broadcast_weights(group, tensors)
            leave_group(group)  # matched by close_weight_update_group on the engine side
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    try:
        await engine.collective_rpc("init_weight_update_group", ("127.0.0.1", port, 1, 1 + TP), timeout=TIMEOUT)
        await engine.collective_rpc("receive_weights", (weight_metadata(tensors),), {"partial": False}, TIMEOUT)
        outputs = await greedy(engine)
    finally:
        await engine.collective_rpc("close_weight_update_group", timeout=TIMEOUT)
        await asyncio.to_thread(thread.join, TIMEOUT)
        await engine.update_weights(llama_ckpt)
    assert not errors and not thread.is_alive()
    assert outputs == expected["B"]
    assert await greedy(engine) == expected["A"]


# ---- the other members of the family ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("arch", "shape"),
    [("qwen2", {"num_kv_heads": 1}), ("qwen3", {})],
    ids=["qwen2-kv-heads-replicated", "qwen3"],
)
async def test_qwen_at_tp2_gives_hfs_and_tp1s_greedy_tokens(
    tmp_path_factory: pytest.TempPathFactory, arch: str, shape: dict[str, int]
) -> None:
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt") / arch, arch, **shape)
    sharded, single, hf, preemptions = await parity(path)
    assert sharded == hf
    assert single == hf
    assert preemptions > 0


# ---- the real model: 9 query heads, 3 KV heads -----------------------------------------------------------------
async def test_the_real_model_at_tp3_gives_hfs_greedy_tokens(real_model: Path) -> None:
    # Three ranks on this 2-core machine meet 90 times a step: a short answer keeps the test quick.
    prompts, new_tokens = PROMPTS[:2], 8
    config = tp_config(real_model, tp=3, cache={"num_blocks": 64})
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        outs = await asyncio.gather(*(final(engine, p, params) for p in prompts))
    assert [list(out.token_ids) for out in outs] == hf_greedy(real_model, prompts, new_tokens)


async def test_the_real_model_at_tp2_is_refused_at_start_naming_its_head_counts(real_model: Path) -> None:
    engine = AsyncEngine(tp_config(real_model, tp=2))
    with pytest.raises(UnsupportedModelError, match="9 attention heads and 3 KV heads"):
        await engine.start()
    assert engine.executor is None, "refused before any rank started"
    await engine.shutdown()


@pytest.mark.parametrize(
    ("change", "named"),
    [({"vocab_size": 1001}, "vocab_size=1001"), ({"intermediate_size": 129}, "intermediate_size=129")],
)
def test_a_split_that_does_not_divide_is_refused_naming_the_count(
    tmp_path: Path, llama_ckpt: Path, change: dict[str, int], named: str
) -> None:
    import json

    from aioengine.model.tp_layout import check_checkpoint_split

    cfg = {**json.loads((llama_ckpt / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    check_checkpoint_split(llama_ckpt, TP)  # the checkpoint itself splits
    with pytest.raises(UnsupportedModelError, match=f"{named} cannot be split over tensor_parallel_size=2"):
        check_checkpoint_split(tmp_path, TP)
