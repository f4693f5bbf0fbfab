"""Specification of the worker extensions in plugins/: InspectExtension and WeightSyncExtension.

Expected values never come from the extension under test: weight sizes and checksums are derived
from the checkpoint files, and outputs after a weight update are compared with an engine started
on the new checkpoint directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import sys
import threading
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from aioengine import AsyncEngine, SamplingParams
from aioengine.errors import CheckpointError, WeightsLostError
from aioengine.model.loader import checkpoint_files, iter_safetensors
from aioengine.testing import build_checkpoint
from plugins.inspect import InspectExtension, tensor_checksum
from plugins.weight_sync import (
    WeightSyncExtension,
    broadcast_weights,
    free_port,
    leave_group,
    trainer_group,
    weight_metadata,
)
from tests.conftest import engine_config
from tests.helpers import last_output, weight_addresses

TIMEOUT = 60.0
"""Seconds any single await on the engine may take: a hang fails its test, not the run."""
REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The quick brown fox", "Once upon a time", "def add(a, b):"]


class Both(InspectExtension, WeightSyncExtension):
    """The documented way to enable both extensions at once."""


def hf_tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    return list(iter_safetensors(checkpoint_files(path)))


_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def param_bytes(path: Path) -> int:
    """Bytes of every tensor in the checkpoint's safetensors files, from their headers alone."""
    total = 0
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                piece = f.get_slice(name)
                total += math.prod(piece.get_shape()) * _DTYPE_BYTES[piece.get_dtype()]
    return total


def checkpoint_checksums(path: Path) -> dict[str, str]:
    """Checksums of the engine's parameters, computed from the checkpoint files (q/k/v, gate/up fused)."""
    tensors = dict(hf_tensors(path))
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    params: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.split(".")[-2]
        for target, parts in fused.items():
            if module in parts:
                if module == parts[0]:
                    params[name.replace(module, target)] = torch.cat([tensors[name.replace(module, p)] for p in parts])
                break
        else:
            params[name] = tensor
    return {name: tensor_checksum(tensor) for name, tensor in params.items()}


def with_extension(extension: Any) -> dict[str, Any]:
    return {"parallel": {"worker_extension_cls": extension}}


async def greedy_outputs(engine: AsyncEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def one(prompt: str) -> list[int]:
        return [out async for out in engine.generate(prompt, params)][-1].token_ids

    async with asyncio.timeout(TIMEOUT):
        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


async def rpc(engine: AsyncEngine, method: Any, *args: Any, **kwargs: Any) -> Any:
    return await engine.collective_rpc(method, args=args, kwargs=kwargs, timeout=TIMEOUT, unique_reply_rank=0)


def data_ptrs(worker: Any) -> dict[str, int]:
    return weight_addresses(worker.model_runner.model)


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as ``llama_ckpt``, other weights."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama_b", "llama", seed=1)


@pytest.fixture(scope="module")
def outputs_b(ckpt_b: Path) -> list[list[int]]:
    """Greedy outputs of an engine started on checkpoint B directly."""

    async def run() -> list[list[int]]:
        async with AsyncEngine(engine_config(ckpt_b)) as engine:
            return await greedy_outputs(engine)

    return asyncio.run(run())


# ---- loading an extension -----------------------------------------------------------------------------
async def test_extension_named_in_config_runs_through_collective_rpc(
    llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    async with make_engine(llama_ckpt, **with_extension("plugins.inspect.InspectExtension")) as engine:
        per_rank = await engine.collective_rpc("model_summary", timeout=TIMEOUT)
        single = await engine.collective_rpc("model_summary", timeout=TIMEOUT, unique_reply_rank=0)
    assert isinstance(per_rank, list) and len(per_rank) == 1
    assert single == per_rank[0]
    assert single["architecture"] == "LlamaForCausalLM"
    assert single["num_params"] * 4 == param_bytes(llama_ckpt)
    assert sum(single["params_per_module"].values()) == single["num_params"]
    assert {"model.embed_tokens", "model.layers", "model.norm", "lm_head"} == set(single["params_per_module"])


async def test_combined_class_offers_the_methods_of_both_extensions(
    llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    async with make_engine(llama_ckpt, **with_extension(Both)) as engine:
        name, tensor = hf_tensors(llama_ckpt)[0]
        written = await rpc(engine, "load_weights_from_tensors", [(name, tensor)])
        report = await rpc(engine, "memory_report")
    assert written.tensors == 1
    assert report["weights_bytes"] > 0


# ---- InspectExtension ---------------------------------------------------------------------------------
async def test_checksums_are_equal_for_two_engines_on_one_checkpoint(
    llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    ext = with_extension("plugins.inspect.InspectExtension")
    async with make_engine(llama_ckpt, **ext) as first, make_engine(llama_ckpt, **ext) as second:
        a = await rpc(first, "weight_checksums")
        b = await rpc(second, "weight_checksums")
    assert a == b == checkpoint_checksums(llama_ckpt)


async def test_memory_report_counts_the_checkpoint_weights_and_the_kv_cache(
    llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    async with make_engine(llama_ckpt, **with_extension("plugins.inspect.InspectExtension")) as engine:
        report = await rpc(engine, "memory_report")
    cfg = engine.model_info
    assert cfg is not None
    block = 16 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_size * 4
    assert report["rank"] == 0 and report["device"] == "cpu"
    assert report["weights_bytes"] == param_bytes(llama_ckpt)  # llama_ckpt is untied: every tensor is a parameter
    assert report["kv_blocks"] == 512
    assert report["kv_cache_bytes"] == 512 * block
    assert report["process_rss_bytes"] > report["weights_bytes"] + report["kv_cache_bytes"]
    assert report["cuda_allocated_bytes"] is None


# ---- WeightSyncExtension: from tensors ----------------------------------------------------------------
async def test_loading_checkpoint_b_tensors_gives_the_outputs_of_an_engine_on_b(
    llama_ckpt: Path, ckpt_b: Path, outputs_b: list[list[int]], make_engine: Callable[..., AsyncEngine]
) -> None:
    tensors = [(name, t.share_memory_()) for name, t in hf_tensors(ckpt_b)]  # as a forked trainer hands them over
    async with make_engine(llama_ckpt, **with_extension(WeightSyncExtension)) as engine:
        before = await greedy_outputs(engine)
        written = await rpc(engine, "load_weights_from_tensors", tensors, partial=False)
        after = await greedy_outputs(engine)
    assert before != outputs_b  # else the comparison below shows nothing
    assert written.tensors == len(tensors)
    assert after == outputs_b


async def test_weight_load_writes_in_place(
    llama_ckpt: Path, ckpt_b: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    async with make_engine(llama_ckpt, **with_extension(WeightSyncExtension)) as engine:
        before = await rpc(engine, data_ptrs)
        await rpc(engine, "load_weights_from_tensors", dict(hf_tensors(ckpt_b)))
        after = await rpc(engine, data_ptrs)
    assert after == before


async def test_checksums_change_only_for_the_parameter_a_weight_load_wrote(
    llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    ckpt = dict(hf_tensors(llama_ckpt))
    prefix = "model.layers.1.self_attn."
    new_k = ckpt[prefix + "k_proj.weight"].clone()
    new_k[0, 0] += 1.0
    expected = tensor_checksum(torch.cat([ckpt[prefix + "q_proj.weight"], new_k, ckpt[prefix + "v_proj.weight"]]))
    async with make_engine(llama_ckpt, **with_extension(Both)) as engine:
        before = await rpc(engine, "weight_checksums")
        await rpc(engine, "load_weights_from_tensors", [(prefix + "k_proj.weight", new_k)])
        after = await rpc(engine, "weight_checksums")
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {prefix + "qkv_proj.weight"}
    assert after[prefix + "qkv_proj.weight"] == expected


@pytest.mark.parametrize(
    ("bad_name", "bad_tensor", "message"),
    [
        ("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 3), "has shape (3, 3)"),
        ("model.layers.1.mlp.upp_proj.weight", torch.zeros(3, 3), "has no place"),
    ],
    ids=["wrong-shape", "unknown-name"],
)
async def test_a_bad_batch_raises_naming_the_tensor_and_changes_nothing(
    llama_ckpt: Path, ckpt_b: Path, make_engine: Callable[..., AsyncEngine],
    bad_name: str, bad_tensor: torch.Tensor, message: str,
) -> None:  # fmt: skip
    # Last, in place of the good one: every good tensor comes before it.
    batch = [(n, t) for n, t in hf_tensors(ckpt_b) if n != bad_name] + [(bad_name, bad_tensor)]
    async with make_engine(llama_ckpt, **with_extension(Both)) as engine:
        outputs = await greedy_outputs(engine)
        before = await rpc(engine, "weight_checksums")
        with pytest.raises(CheckpointError, match="nothing was written") as err:
            await rpc(engine, "load_weights_from_tensors", batch)
        assert repr(bad_name) in str(err.value) and message in str(err.value)
        assert await rpc(engine, "weight_checksums") == before
        assert await greedy_outputs(engine) == outputs  # still serving, on the old weights


async def test_a_full_update_missing_a_tensor_is_refused_before_writing(
    llama_ckpt: Path, ckpt_b: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    batch = [(name, t) for name, t in hf_tensors(ckpt_b) if name != "model.layers.1.mlp.gate_proj.weight"]
    async with make_engine(llama_ckpt, **with_extension(Both)) as engine:
        before = await rpc(engine, "weight_checksums")
        with pytest.raises(CheckpointError, match=r"partial=False.*model\.layers\.1\.mlp\.gate_up_proj\.weight"):
            await rpc(engine, "load_weights_from_tensors", batch, partial=False)
        assert await rpc(engine, "weight_checksums") == before


# ---- WeightSyncExtension: over a process group -------------------------------------------------------
TRAINER = """
import sys, torch
from datetime import timedelta
from safetensors.torch import load_file
from plugins.weight_sync import broadcast_weights, leave_group, trainer_group

def main():  # the group lives in locals: it must be gone before the interpreter finalizes
    ckpt, port = sys.argv[1], int(sys.argv[2])
    store, group = trainer_group(port, world_size=2, timeout=timedelta(seconds=30))
    broadcast_weights(group, load_file(ckpt))
    leave_group(group)  # the engine passes the same barrier in close_weight_update_group

torch.set_num_threads(1)
main()
"""
"""A trainer program: hosts the group on 127.0.0.1:port and broadcasts a safetensors file."""


async def test_weights_broadcast_by_a_trainer_process_give_the_outputs_of_an_engine_on_b(
    llama_ckpt: Path, ckpt_b: Path, outputs_b: list[list[int]], make_engine: Callable[..., AsyncEngine]
) -> None:
    (file,) = checkpoint_files(ckpt_b)
    metadata = weight_metadata(load_file(file))  # what the trainer will send, in its order
    port = free_port()
    async with make_engine(llama_ckpt, **with_extension(WeightSyncExtension)) as engine:
        trainer = await asyncio.create_subprocess_exec(sys.executable, "-c", TRAINER, str(file), str(port),
                                                       cwd=REPO, stderr=asyncio.subprocess.PIPE)  # fmt: skip
        try:
            await rpc(engine, "init_weight_update_group", "127.0.0.1", port, 1, 2, timeout_s=30.0)
            written = await rpc(engine, "receive_weights", metadata, partial=False)
            outputs = await greedy_outputs(engine)
            version_seen = (await last_output(engine.generate(PROMPTS[0], {"max_tokens": 2}))).weights_version
        finally:
            await rpc(engine, "close_weight_update_group")
            try:
                async with asyncio.timeout(TIMEOUT):
                    _, stderr = await trainer.communicate()
            finally:
                if trainer.returncode is None:
                    trainer.kill()
                    await trainer.wait()
    assert trainer.returncode == 0, stderr.decode()
    assert written.tensors == len(metadata)
    assert written.weights_version == engine.weights_version == version_seen == 1  # outputs carry the push
    assert outputs == outputs_b


@contextlib.asynccontextmanager
async def trainer_in_thread(engine: AsyncEngine, batches: list[Any]) -> AsyncIterator[None]:
    """A trainer in a thread (enough: the group is private, nothing global is touched) hosts a group the
    engine joins, and broadcasts each batch in turn. On exit the engine leaves the group (the trainer then
    passes the closing barrier) and the trainer must have ended without an error."""
    port = free_port()
    release = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _store, group = trainer_group(port, world_size=2, timeout=timedelta(seconds=30))
            for batch in batches:
                broadcast_weights(group, batch)
            release.wait(TIMEOUT)
            leave_group(group)  # matched by close_weight_update_group on the engine side
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        await rpc(engine, "init_weight_update_group", "127.0.0.1", port, 1, 2, timeout_s=30.0)
        yield
    finally:
        release.set()
        await rpc(engine, "close_weight_update_group")
        await asyncio.to_thread(thread.join, TIMEOUT)
    assert not errors and not thread.is_alive()


async def test_a_rejected_broadcast_changes_nothing_and_keeps_the_group_in_step(
    llama_ckpt: Path, ckpt_b: Path, outputs_b: list[list[int]], make_engine: Callable[..., AsyncEngine]
) -> None:
    good = hf_tensors(ckpt_b)
    bad_name = "model.layers.1.mlp.up_proj.weight"
    bad = [(n, t) for n, t in good if n != bad_name] + [(bad_name, torch.zeros(3, 3))]  # the last one does not fit
    async with make_engine(llama_ckpt, **with_extension(Both)) as engine:
        before = await rpc(engine, "weight_checksums")
        async with trainer_in_thread(engine, [bad, good]):
            with pytest.raises(CheckpointError, match=re.escape("'model.layers.1.mlp.up_proj.weight' has shape")):
                await rpc(engine, "receive_weights", weight_metadata(bad))
            unchanged = await rpc(engine, "weight_checksums") == before
            await rpc(engine, "receive_weights", weight_metadata(good), partial=False)
            outputs = await greedy_outputs(engine)
    assert unchanged
    assert outputs == outputs_b


async def test_a_broadcast_that_breaks_midway_discards_the_weights_and_the_next_push_restores_them(
    llama_ckpt: Path, ckpt_b: Path, outputs_b: list[list[int]], make_engine: Callable[..., AsyncEngine]
) -> None:
    # A NaN found after the first write: the weights are lost, the rest of the broadcast is still taken (the
    # receive runs one tensor ahead of the write, so this also checks that nothing is left half received),
    # and a full push afterwards serves again.
    good = hf_tensors(ckpt_b)
    middle = len(good) // 2
    bad = [(n, torch.full_like(t, float("nan")) if i == middle else t) for i, (n, t) in enumerate(good)]
    async with (
        make_engine(llama_ckpt, **with_extension(WeightSyncExtension)) as engine,
        trainer_in_thread(engine, [bad, good]),
    ):
        with pytest.raises(WeightsLostError, match=re.escape(bad[middle][0])):
            await rpc(engine, "receive_weights", weight_metadata(bad), partial=False)
        await rpc(engine, "receive_weights", weight_metadata(good), partial=False)
        outputs = await greedy_outputs(engine)
    assert outputs == outputs_b
