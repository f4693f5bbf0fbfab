"""Control calls (sleep, wake, weight updates) and the one session they share (EngineCore.control).

A worker call that has started runs to its end and its outcome is recorded, whatever happens to
its caller; a call that fails, or is cancelled before its worker call starts, leaves the engine as
it was; weight writes through an extension count like update_weights.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from aioengine import AsyncEngine, SamplingParams
from aioengine.errors import CheckpointError, WeightsLostError
from aioengine.testing import build_checkpoint
from tests.conftest import engine_config
from tests.helpers import final, hf_generate, wait_until

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 99, 17, 23]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SYNC_EXTENSION = {"parallel": {"worker_extension_cls": "plugins.weight_sync.WeightSyncExtension"}}


def slow_down(worker: Any, method: str, seconds: float) -> None:
    """Runs on the worker thread: makes ``worker.<method>`` take ``seconds`` longer (it then runs as before)."""
    original = getattr(worker, method)

    def slowed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return original(*args, **kwargs)

    setattr(worker, method, slowed)


def calls_started(worker: Any, method: str, started: list[str]) -> None:
    """Runs on the worker thread: records in ``started`` when ``worker.<method>`` begins."""
    original = getattr(worker, method)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        started.append(method)
        return original(*args, **kwargs)

    setattr(worker, method, recorded)


async def tokens(engine: AsyncEngine) -> list[list[int]]:
    outs = await asyncio.gather(*(final(engine, p, GREEDY) for p in PROMPTS))
    return [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama-b", "llama", seed=1)


@pytest.fixture
async def engine(llama_ckpt: Path) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(engine_config(llama_ckpt, **SYNC_EXTENSION)) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(llama_ckpt: Path, ckpt_b: Path) -> dict[str, list[list[int]]]:
    """HF transformers' greedy tokens for PROMPTS on checkpoints A and B."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for name, path in (("A", llama_ckpt), ("B", ckpt_b)):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        refs[name] = hf_generate(model, PROMPTS, GREEDY.max_tokens)
    assert refs["A"] != refs["B"]
    return refs


# ---- a caller that goes away -----------------------------------------------------------------------------
async def test_a_sleep_whose_caller_times_out_completes_and_the_engine_stays_whole(
    engine: AsyncEngine, reference: dict[str, list[list[int]]]
) -> None:
    started: list[str] = []
    await engine.collective_rpc(slow_down, args=("sleep", 0.5))
    await engine.collective_rpc(calls_started, args=("sleep", started))
    sleeping = asyncio.ensure_future(engine.sleep(level=1))
    await wait_until(lambda: started == ["sleep"], "the worker's sleep began")
    sleeping.cancel()  # as asyncio.wait_for does on timeout, with the worker mid-sleep
    with pytest.raises(asyncio.CancelledError):
        await sleeping
    late = asyncio.ensure_future(final(engine, PROMPTS[0], GREEDY))  # submitted meanwhile: waits for the wake
    report = await engine.wake_up()  # the next control call waits for the sleep to be over
    assert report.restored_bytes.kv_cache > 0, "the sleep ran to its end and was recorded, so the wake restores"
    assert not await engine.is_sleeping()
    assert list((await late).token_ids) == reference["A"][0]
    assert await tokens(engine) == reference["A"]


async def test_a_wait_for_around_sleep_times_out_without_killing_the_engine(
    engine: AsyncEngine, reference: dict[str, list[list[int]]]
) -> None:
    await engine.collective_rpc(slow_down, args=("sleep", 0.3))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(engine.sleep(level=2), 0.05)
    await engine.wake_up()
    assert engine.stats().weights_valid is False  # the level-2 sleep happened and is known
    await engine.reload_weights()
    assert not engine.stats().dead
    assert await tokens(engine) == reference["A"]


async def test_cancelling_an_update_in_its_worker_call_still_swaps_and_counts_the_version(
    engine: AsyncEngine, ckpt_b: Path, reference: dict[str, list[list[int]]]
) -> None:
    started: list[str] = []
    await engine.collective_rpc(slow_down, args=("update_weights", 0.3))
    await engine.collective_rpc(calls_started, args=("update_weights", started))
    update = asyncio.ensure_future(engine.update_weights(ckpt_b))
    await wait_until(lambda: started == ["update_weights"], "the worker's update began")
    update.cancel()
    with pytest.raises(asyncio.CancelledError):
        await update
    out = await final(engine, PROMPTS[0], GREEDY)  # runs once the write is over, on the new weights
    assert out.weights_version == 1 == engine.weights_version
    assert list(out.token_ids) == reference["B"][0]


async def test_cancelling_a_sleep_while_it_drains_leaves_the_engine_awake_and_loses_nothing(
    engine: AsyncEngine, reference: dict[str, list[list[int]]]
) -> None:
    long = asyncio.ensure_future(final(engine, PROMPTS[1], SamplingParams(max_tokens=60, temperature=0)))
    await wait_until(lambda: engine.stats().requests_running == 1, "the long request runs")
    sleeping = asyncio.ensure_future(engine.sleep(level=1, mode="wait"))
    await wait_until(lambda: engine.stats().draining, "the sleep drains")
    held = asyncio.ensure_future(final(engine, PROMPTS[0], GREEDY))
    await wait_until(lambda: engine.stats().requests_held == 1, "a request that arrives during the drain is held")
    sleeping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeping
    assert not await engine.is_sleeping()
    assert not engine.stats().draining
    assert list((await held).token_ids) == reference["A"][0]
    assert len((await long).token_ids) == 60


# ---- weight writes through an extension --------------------------------------------------------------
async def test_a_tensor_push_through_the_weight_sync_extension_bumps_the_version_outputs_carry(
    engine: AsyncEngine, ckpt_b: Path, reference: dict[str, list[list[int]]]
) -> None:
    before = await final(engine, PROMPTS[0], GREEDY)
    report = await engine.collective_rpc("load_weights_from_tensors", args=(load_file(ckpt_b / "model.safetensors"),),
                                         kwargs={"partial": False}, unique_reply_rank=0)  # fmt: skip
    assert report.weights_version == 1 == engine.weights_version
    after = await final(engine, PROMPTS[0], GREEDY)
    assert (before.weights_version, after.weights_version) == (0, 1)
    assert await tokens(engine) == reference["B"]


async def test_a_full_push_after_a_level_2_sleep_makes_the_engine_serve_again(
    engine: AsyncEngine, ckpt_b: Path, reference: dict[str, list[list[int]]]
) -> None:
    # The RL loop: sleep(2) while training, wake, push the trained weights, go on. No reload needed.
    await engine.sleep(level=2)
    await engine.wake_up()
    assert engine.stats().weights_valid is False
    await engine.collective_rpc("load_weights_from_tensors", args=(load_file(ckpt_b / "model.safetensors"),),
                                kwargs={"partial": False})  # fmt: skip
    assert engine.stats().weights_valid is True
    assert await tokens(engine) == reference["B"]


async def test_a_partial_push_after_a_level_2_sleep_does_not_make_the_weights_valid(
    engine: AsyncEngine, ckpt_b: Path
) -> None:
    await engine.sleep(level=2)
    await engine.wake_up()
    one = dict(list(load_file(ckpt_b / "model.safetensors").items())[:1])
    report = await engine.collective_rpc("load_weights_from_tensors", args=(one,), unique_reply_rank=0)
    assert report.weights_valid is False
    assert engine.stats().weights_valid is False  # the rest is still discarded: no step may run
    await engine.reload_weights()
    assert engine.stats().weights_valid is True


# ---- weight writes are all or nothing ------------------------------------------------------------------
def _b_with_last(ckpt_b: Path, last: torch.Tensor) -> dict[str, torch.Tensor]:
    """Checkpoint B's tensors, the last one (in order) replaced by ``last``."""
    tensors = load_file(ckpt_b / "model.safetensors")
    name = list(tensors)[-1]
    tensors[name] = last
    return tensors


@pytest.mark.parametrize("path", ["update_weights", "weight_sync"])
@pytest.mark.parametrize("bad", ["meta", "nan", "inf", "sparse"])
async def test_a_source_whose_last_tensor_cannot_be_written_changes_nothing(
    engine: AsyncEngine, ckpt_b: Path, reference: dict[str, list[list[int]]], path: str, bad: str
) -> None:
    shape = list(load_file(ckpt_b / "model.safetensors").values())[-1].shape
    last = {
        "meta": torch.empty(shape, device="meta"),
        "nan": torch.full(shape, float("nan")),
        "inf": torch.full(shape, float("inf")),
        "sparse": torch.zeros(shape).to_sparse(),
    }[bad]
    source = _b_with_last(ckpt_b, last)
    with pytest.raises(CheckpointError, match=repr(list(source)[-1])):
        if path == "update_weights":
            await engine.update_weights(source)
        else:
            await engine.collective_rpc("load_weights_from_tensors", (source,), {"partial": False})
    assert engine.weights_version == 0
    assert engine.stats().weights_valid
    assert await tokens(engine) == reference["A"]


async def test_a_dtensor_from_an_fsdp2_state_dict_is_refused_naming_full_tensor(
    engine: AsyncEngine, ckpt_b: Path, reference: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        tensors = load_file(ckpt_b / "model.safetensors")
        name = list(tensors)[-1]
        tensors[name] = distribute_tensor(tensors[name], init_device_mesh("cpu", (1,)), [Shard(0)])
        with pytest.raises(CheckpointError, match=r"DTensor.*full_tensor\(\)"):
            await engine.update_weights(tensors)
    finally:
        dist.destroy_process_group()
    assert engine.weights_version == 0
    assert await tokens(engine) == reference["A"]


async def test_non_finite_weights_are_written_when_explicitly_allowed(engine: AsyncEngine, ckpt_b: Path) -> None:
    tensors = load_file(ckpt_b / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    report = await engine.update_weights({name: torch.full_like(tensors[name], float("nan"))}, partial=True,
                                         allow_non_finite=True)  # fmt: skip
    assert report.tensors == 1 and report.weights_version == 1


@pytest.fixture
def sharded_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama-b-sharded", "llama", seed=1, num_shards=2)


async def test_a_shard_that_vanishes_mid_update_leaves_the_engine_refusing_to_serve_a_mix(
    engine: AsyncEngine, sharded_b: Path, llama_ckpt: Path, reference: dict[str, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from aioengine.worker import weights

    shards = sorted(sharded_b.glob("*.safetensors"))
    real = weights.iter_safetensors

    def vanishing(files: Any, select: Any = None) -> Any:
        for i, item in enumerate(real(files, select)):
            yield item
            if i == 0:
                shards[-1].unlink()  # the trainer's cleanup removes the next shard while we stream

    monkeypatch.setattr(weights, "iter_safetensors", vanishing)
    with pytest.raises(WeightsLostError, match="serves nothing until"):
        await engine.update_weights(sharded_b)
    assert engine.stats().weights_valid is False
    waiting = asyncio.ensure_future(final(engine, PROMPTS[0], GREEDY))
    await wait_until(lambda: engine.stats().requests_waiting == 1, "the request is queued")
    assert not waiting.done()
    monkeypatch.setattr(weights, "iter_safetensors", real)
    await engine.update_weights(llama_ckpt)  # a full write: serving again, on A
    assert list((await waiting).token_ids) == reference["A"][0]


async def test_a_streamed_file_with_a_nan_tensor_is_refused_before_the_write_or_loses_the_weights(
    engine: AsyncEngine, ckpt_b: Path, llama_ckpt: Path, reference: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    tensors = load_file(ckpt_b / "model.safetensors")
    last = list(tensors)[-1]
    tensors[last] = torch.full_like(tensors[last], float("nan"))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsLostError, match="NaN or Inf"):
        await engine.update_weights(tmp_path / "model.safetensors")
    assert engine.stats().weights_valid is False  # never a mix served
    with pytest.raises(CheckpointError, match="NaN or Inf"):  # staged: checked before the first write
        await engine.update_weights(tmp_path / "model.safetensors", stage=True)
    await engine.reload_weights()
    assert await tokens(engine) == reference["A"]


async def test_a_streamed_update_checks_values_in_its_write_and_a_dict_before_it(
    engine: AsyncEngine, ckpt_b: Path, kernel: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the kernels, a file's tensors are checked in the pass that writes them (no read of their own);
    a dict is still checked whole, one read per tensor, before anything is written."""
    from aioengine.model import loader
    from aioengine.worker import weights

    calls: list[int] = []
    all_finite = loader.all_finite

    def counted(tensor: torch.Tensor) -> bool:
        calls.append(tensor.numel())
        return all_finite(tensor)

    monkeypatch.setattr(weights, "all_finite", counted)
    monkeypatch.setattr(loader, "all_finite", counted)
    await engine.update_weights(ckpt_b)
    assert calls == []
    tensors = load_file(ckpt_b / "model.safetensors")
    await engine.update_weights(tensors)
    assert sorted(calls) == sorted(t.numel() for t in tensors.values())


def test_the_finite_check_is_exact_when_a_sum_of_finite_weights_overflows() -> None:
    from aioengine.worker.weights import check_tensor

    check_tensor("big", torch.full((8,), 3e38))  # the sum overflows to inf, every element is finite
    check_tensor("half", torch.full((8,), 60000.0, dtype=torch.float16))
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(CheckpointError, match="NaN or Inf"):
            check_tensor("w", torch.tensor([1.0, bad, 2.0]))
