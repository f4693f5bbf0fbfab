"""Specification of hot weight swap through the public API: AsyncEngine.update_weights,
reload_weights, weights_version and RequestOutput.weights_version.

Two random-init checkpoints of the same shape: A (the engine's, seed 0) and B (seed 1). Expected
tokens come from HF transformers ``generate`` on the same checkpoints (float32, one prompt at a
time), never from the engine. Expected weights come from per-parameter sha256 checksums read on
the worker thread (``collective_rpc`` with a callable), so "nothing changed" means bit for bit.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aioengine import AsyncEngine
from aioengine.errors import CheckpointError, EngineStateError
from aioengine.model import linear
from aioengine.worker import worker as worker_module
from tests.helpers import TIMEOUT, wait_until, weight_addresses
from tests.weight_swap_support import (
    FEW,
    NEW_TOKENS,
    PROMPTS,
    b_tensors,
    checksums,
    final,
    greedy,
    hf_greedy,
    token_ids,
)


# ---- a good swap: outputs follow the new weights, from every kind of source --------------------------
def test_checkpoints_a_and_b_give_different_greedy_outputs_for_every_prompt(ref: dict[str, list[list[int]]]) -> None:
    # The swap tests below only prove something if A and B disagree on every prompt.
    assert all(len(t) == NEW_TOKENS for t in ref["A"] + ref["B"])
    assert all(a != b for a, b in zip(ref["A"], ref["B"], strict=True))


SOURCES: dict[str, Callable[[Path], tuple[Any, bool]]] = {
    "directory": lambda ckpt: (ckpt, False),
    "file": lambda ckpt: (ckpt / "model.safetensors", False),
    "dict": lambda ckpt: (b_tensors(ckpt), False),
    "iterator": lambda ckpt: ((pair for pair in b_tensors(ckpt).items()), False),
    "staged": lambda ckpt: (ckpt, True),
}


@pytest.mark.parametrize("kind", list(SOURCES))
async def test_swap_to_b_gives_hf_outputs_of_b_and_swap_back_gives_those_of_a(
    engine: AsyncEngine, kind: str, llama_ckpt: Path, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    assert await token_ids(engine) == ref["A"][:FEW]
    source, stage = SOURCES[kind](ckpt_b)
    await engine.update_weights(source, stage=stage)
    assert await token_ids(engine) == ref["B"][:FEW]
    source, stage = SOURCES[kind](llama_ckpt)
    await engine.update_weights(source, stage=stage)
    assert await token_ids(engine) == ref["A"][:FEW]


async def test_a_staged_file_is_read_at_staging_so_rewriting_the_file_before_the_swap_changes_nothing(
    engine: AsyncEngine, llama_ckpt: Path, ckpt_b: Path, tmp_path: Path, ref: dict[str, list[list[int]]]
) -> None:
    # A trainer writes its next checkpoint over the file the engine staged. What was staged (and
    # checked) must be what is swapped in: staging reads the bytes, it does not keep a view of the file.
    file = tmp_path / "next.safetensors"
    file.write_bytes((ckpt_b / "model.safetensors").read_bytes())
    in_flight = asyncio.create_task(final(engine, PROMPTS[0], greedy(100)))  # keeps the drain going a while
    await wait_until(lambda: engine.stats().requests_running == 1, "the request running")
    update = asyncio.create_task(engine.update_weights(file, mode="drain", stage=True))
    await wait_until(lambda: update.done() or engine.stats().draining, "staged and draining")
    assert not update.done(), "the drain was over before the file could be rewritten"
    with open(file, "r+b") as f:  # in place, as a trainer saving to the same path does
        f.write((llama_ckpt / "model.safetensors").read_bytes())
    await update
    await in_flight
    assert await token_ids(engine) == ref["B"][:FEW]


async def test_outputs_after_a_swap_carry_the_new_weights_version(engine: AsyncEngine, ckpt_b: Path) -> None:
    before = await final(engine, PROMPTS[0])
    await engine.update_weights(ckpt_b)
    after = await final(engine, PROMPTS[0])
    assert (before.weights_version, after.weights_version) == (0, 1)


async def test_reload_weights_restores_the_configured_checkpoint(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    await engine.update_weights(ckpt_b)
    await engine.reload_weights()
    assert await token_ids(engine) == ref["A"][:FEW]


async def test_a_float64_source_is_cast_and_gives_hf_outputs_of_b(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    # float32 -> float64 -> float32 is exact, so the engine must hold B bit for bit.
    await engine.update_weights(b_tensors(ckpt_b, torch.float64))
    assert await token_ids(engine) == ref["B"][:FEW]


async def test_a_bfloat16_source_is_cast_and_gives_hf_outputs_of_b_rounded_to_bfloat16(
    engine: AsyncEngine, ckpt_b: Path
) -> None:
    await engine.update_weights(b_tensors(ckpt_b, torch.bfloat16))
    dtypes = await engine.collective_rpc(lambda w: {p.dtype for p in w.model_runner.model.parameters()})
    assert dtypes == [{torch.float32}]
    assert await token_ids(engine) == hf_greedy(ckpt_b, PROMPTS[:FEW], round_trip=torch.bfloat16)


# ---- a bad source changes nothing -------------------------------------------------------------------
def _truncated(ckpt: Path, tmp: Path) -> Path:
    data = (ckpt / "model.safetensors").read_bytes()
    (tmp / "cut.safetensors").write_bytes(data[:-100])
    return tmp / "cut.safetensors"


def _garbage(ckpt: Path, tmp: Path) -> Path:
    (tmp / "garbage.safetensors").write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    return tmp / "garbage.safetensors"


def _replace(ckpt: Path, name: str, tensor: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = b_tensors(ckpt)
    tensors[name] = tensor(tensors[name])
    return tensors


def _without(ckpt: Path, name: str) -> dict[str, torch.Tensor]:
    tensors = b_tensors(ckpt)
    del tensors[name]
    return tensors


def _duplicated(ckpt: Path) -> Iterator[tuple[str, torch.Tensor]]:
    tensors = b_tensors(ckpt)
    yield from tensors.items()
    yield "model.layers.0.mlp.down_proj.weight", tensors["model.layers.0.mlp.down_proj.weight"]


# Each bad tensor comes LAST in its source, so a loader that writes before it has checked everything
# would already have changed the model when it fails. Values: (source, stage, regex of the message).
BAD_SOURCES: dict[str, Callable[[Path, Path], tuple[Any, bool, str]]] = {
    "missing tensor": lambda b, tmp: (_without(b, "model.norm.weight"), False, r"missing.*model\.norm\.weight"),
    "missing part of a fused tensor": lambda b, tmp: (
        _without(b, "model.layers.1.self_attn.k_proj.weight"),
        False,
        r"missing.*model\.layers\.1\.self_attn.*k_proj",
    ),
    "unknown name": lambda b, tmp: (
        {**b_tensors(b), "model.layers.1.mlp.extra_proj.weight": torch.zeros(4)},
        False,
        r"model\.layers\.1\.mlp\.extra_proj\.weight.*no place",
    ),
    "wrong shape": lambda b, tmp: (
        _replace(b, "model.norm.weight", lambda t: torch.cat([t, t])),
        False,
        r"model\.norm\.weight.*shape \(128,\)",
    ),
    "int64 dtype": lambda b, tmp: (
        _replace(b, "model.norm.weight", lambda t: t.to(torch.int64)),
        False,
        r"model\.norm\.weight.*int64.*cannot",
    ),
    "truncated file": lambda b, tmp: (_truncated(b, tmp), False, r"cut\.safetensors"),
    "corrupt file": lambda b, tmp: (_garbage(b, tmp), False, r"garbage\.safetensors"),
    "duplicated name": lambda b, tmp: (_duplicated(b), False, r"model\.layers\.0\.mlp\.down_proj\.weight.*twice"),
    "missing path": lambda b, tmp: (tmp / "nowhere", False, r"nowhere.*does not exist"),
    "wrong shape, staged": lambda b, tmp: (
        _replace(b, "model.norm.weight", lambda t: t[:-1]),
        True,
        r"model\.norm\.weight.*shape \(63,\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
async def test_a_bad_source_is_refused_naming_the_problem_and_changes_nothing(
    engine: AsyncEngine, case: str, ckpt_b: Path, tmp_path: Path, ref: dict[str, list[list[int]]]
) -> None:
    source, stage, message = BAD_SOURCES[case](ckpt_b, tmp_path)
    before = await checksums(engine)
    with pytest.raises(CheckpointError, match=message):
        await engine.update_weights(source, stage=stage)
    assert await checksums(engine) == before
    assert engine.weights_version == 0
    assert await token_ids(engine) == ref["A"][:FEW]


async def test_an_unknown_mode_is_refused_with_value_error_and_changes_nothing(
    engine: AsyncEngine, ckpt_b: Path
) -> None:
    before = await checksums(engine)
    with pytest.raises(ValueError, match="'swap'"):
        await engine.update_weights(ckpt_b, mode="swap")
    assert await checksums(engine) == before
    assert engine.weights_version == 0


# ---- partial updates, in place -----------------------------------------------------------------------
async def test_a_partial_update_of_one_layer_changes_exactly_that_layers_parameters_to_b(
    engine: AsyncEngine, ckpt_b: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    async with make_engine(ckpt_b) as engine_b:
        b = await checksums(engine_b)
    layer_1 = {n: t for n, t in b_tensors(ckpt_b).items() if n.startswith("model.layers.1.")}
    before = await checksums(engine)
    await engine.update_weights(layer_1, partial=True)
    after = await checksums(engine)
    in_layer_1 = {n for n in before if n.startswith("model.layers.1.")}
    assert any(b[n] != before[n] for n in in_layer_1)  # (the norms start as ones in both checkpoints)
    assert after == {n: b[n] if n in in_layer_1 else before[n] for n in before}


async def test_one_layer_without_partial_is_refused_as_missing_tensors(engine: AsyncEngine, ckpt_b: Path) -> None:
    layer_1 = {n: t for n, t in b_tensors(ckpt_b).items() if n.startswith("model.layers.1.")}
    before = await checksums(engine)
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.0\."):
        await engine.update_weights(layer_1, partial=False)
    assert await checksums(engine) == before


@pytest.mark.parametrize("stage", [False, True], ids=["streamed", "staged"])
async def test_an_update_writes_in_place_keeping_every_parameter_address(
    engine: AsyncEngine, ckpt_b: Path, stage: bool
) -> None:
    def addresses(worker: Any) -> dict[str, int]:
        return weight_addresses(worker.model_runner.model)

    before = await engine.collective_rpc(addresses)
    checks = await checksums(engine)
    await engine.update_weights(ckpt_b, stage=stage)
    assert await checksums(engine) != checks  # the weights did change...
    assert await engine.collective_rpc(addresses) == before  # ...where they were


# ---- the report and the version counter -----------------------------------------------------------------
SLOW_READ = 0.3
"""Seconds the source below takes to read: long beside the copy of this small model's weights."""


def slow_source(ckpt: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """B's tensors, from an iterator that needs ``SLOW_READ`` seconds before its first tensor."""
    time.sleep(SLOW_READ)
    yield from b_tensors(ckpt).items()


async def test_the_report_gives_tensors_bytes_and_the_new_version_of_the_source(
    engine: AsyncEngine, ckpt_b: Path
) -> None:
    tensors = b_tensors(ckpt_b)
    version = engine.weights_version
    report = await engine.update_weights(ckpt_b)
    assert (report.mode, report.tensors) == ("pause", len(tensors))
    assert report.bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert report.weights_version == engine.weights_version == version + 1
    assert (report.aborted, report.preempted) == (0, 0)


@pytest.mark.parametrize("stage", [False, True], ids=["streamed", "staged"])
async def test_the_pause_covers_the_read_of_a_streamed_source_and_only_the_copy_of_a_staged_one(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]], stage: bool
) -> None:
    started = time.perf_counter()
    report = await engine.update_weights(slow_source(ckpt_b), stage=stage)
    elapsed = time.perf_counter() - started
    assert report.seconds <= elapsed  # the whole call, nothing more
    if stage:  # read and checked while the engine served; the pause is the copy alone
        assert report.seconds - report.pause_seconds >= SLOW_READ
        assert report.pause_seconds < SLOW_READ
    else:  # read during the pause
        assert report.pause_seconds >= SLOW_READ
    assert await token_ids(engine) == ref["B"][:FEW]


@pytest.mark.skipif(
    not linear.cpu_prepack_supported(torch.device("cpu"), torch.float32), reason="no oneDNN-packed linear layers here"
)
async def test_staging_beside_serving_leaves_a_running_forward_the_packed_weights_it_runs_from(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # stage=True checks the source on another thread while steps run. A forward is held in its first linear
    # layer, after it found the layer's packed copy current and before it uses it, until the staging is done:
    # had the check dropped the copy, the layer would compute from None (an empty output; the engine died).
    held, staged = threading.Event(), threading.Event()
    weight_key, stage = linear._weight_key, worker_module.stage_weights

    def weight_key_holding_the_first_forward(weight: torch.Tensor) -> tuple[int, int]:
        if sys._getframe(1).f_code.co_name == "_ensure_packed" and not held.is_set():
            held.set()
            staged.wait(TIMEOUT)
        return weight_key(weight)

    def stage_then_let_the_forward_go_on(*args: Any, **kwargs: Any) -> Any:
        try:
            return stage(*args, **kwargs)
        finally:
            staged.set()

    monkeypatch.setattr(linear, "_weight_key", weight_key_holding_the_first_forward)
    monkeypatch.setattr(worker_module, "stage_weights", stage_then_let_the_forward_go_on)
    request = asyncio.create_task(final(engine, PROMPTS[0], greedy(1)))
    await wait_until(held.is_set, "a forward held in its first linear layer")
    await engine.update_weights(ckpt_b, stage=True)
    assert list((await request).token_ids) == ref["A"][0][:1]  # the held step ran on A, whole
    assert await token_ids(engine) == ref["B"][:FEW]


async def test_weights_version_counts_successful_updates_only(engine: AsyncEngine, ckpt_b: Path) -> None:
    versions = [engine.weights_version]
    await engine.update_weights(ckpt_b)
    versions.append(engine.weights_version)
    with pytest.raises(CheckpointError):
        await engine.update_weights(_without(ckpt_b, "model.norm.weight"))
    versions.append(engine.weights_version)
    report = await engine.update_weights(ckpt_b, mode="drain")
    versions.append(engine.weights_version)
    assert versions == [0, 1, 1, 2]
    assert report.weights_version == 2
    assert (await final(engine, PROMPTS[0])).weights_version == 2


# ---- together with sleep ----------------------------------------------------------------------------
async def test_level_2_sleep_then_wake_weights_update_to_b_and_wake_kv_cache_gives_outputs_of_b(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    await engine.sleep(level=2)
    await engine.wake_up(["weights"])
    await engine.update_weights(ckpt_b)
    await engine.wake_up(["kv_cache"])
    assert await token_ids(engine) == ref["B"][:FEW]


async def test_level_1_sleep_then_wake_then_update_to_b_gives_outputs_of_b(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    await engine.sleep(level=1)
    await engine.wake_up()
    await engine.update_weights(ckpt_b)
    assert await token_ids(engine) == ref["B"][:FEW]


async def test_updating_weights_that_are_asleep_is_refused_with_engine_state_error(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    await engine.sleep(level=1)
    with pytest.raises(EngineStateError, match="wake_up"):
        await engine.update_weights(ckpt_b)
    await engine.wake_up()
    assert engine.weights_version == 0
    assert await token_ids(engine) == ref["A"][:FEW]


async def test_drain_while_the_kv_cache_sleeps_with_a_request_queued_is_refused_instead_of_waiting_forever(
    engine: AsyncEngine, ckpt_b: Path, ref: dict[str, list[list[int]]]
) -> None:
    await engine.sleep(level=1)
    queued = asyncio.create_task(final(engine, PROMPTS[0]))
    await wait_until(lambda: engine.stats().requests_waiting == 1, "the request queued for the wake")
    await engine.wake_up(["weights"])
    with pytest.raises(EngineStateError, match="drain"):
        async with asyncio.timeout(TIMEOUT):
            await engine.update_weights(ckpt_b, mode="drain")
    await engine.wake_up(["kv_cache"])
    assert list((await queued).token_ids) == ref["A"][0]
    assert engine.weights_version == 0
