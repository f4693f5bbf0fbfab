"""Hot weight swap on the worker: check the whole source first, then write in place tensor by tensor.

A source is a safetensors file or directory, a ``{name: tensor}`` mapping, an iterable of
``(name, tensor)`` pairs, or :class:`StagedWeights` (already read and checked). Names are the
checkpoint's (HF) names; fused q/k/v and gate/up are mapped by the model. Nothing is written until
every tensor's name, shape and dtype has passed; tensors held in memory are also checked to be
readable (materialised, plain strided tensors, not DTensor shards) and finite before the first
write. Files are streamed (peak extra memory: one tensor), so their data is checked as it is written
(in the same pass, where the C++ kernels copy): a tensor that is not finite, or a file that breaks
after the first write, raises ``WeightsLostError`` and the weights count as discarded until a full
write succeeds; never a mix served. ``stage=True`` reads everything first and so is all-or-nothing for
files too. Writes copy into the existing parameters: addresses (and captured CUDA graphs) stay valid.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from aioengine.errors import CheckpointError, WeightsLostError
from aioengine.model.llama import LlamaForCausalLM
from aioengine.model.loader import (
    Selector,
    TensorSpec,
    WeightPlan,
    all_finite,
    checkpoint_files,
    iter_safetensors,
    narrowed,
    safetensors_specs,
)


@dataclass(slots=True)
class StagedWeights:
    """A source read into host memory and checked against the model (``stage=True``): this rank's parts of
    the tensors the model takes, and the specs of the whole source (what the write checks again)."""

    specs: list[TensorSpec]
    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int


WeightSource = str | os.PathLike[str] | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | StagedWeights
TensorStream = Callable[[Selector], Iterator[tuple[str, torch.Tensor]]]
"""Yields ``(name, tensor)`` for the names the selector places, each tensor already this rank's part
(``Shard``), lazily where it can (files, a broadcast)."""


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is torch's DTensor (what an FSDP2 ``state_dict()`` hands over). Only a process that
    imported ``torch.distributed.tensor`` can hold one, so the check never imports it (a second at start-up)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


@dataclass(frozen=True, slots=True)
class SourceView:
    """What the write path needs of a source: its specs, a way to stream it, and whether every tensor
    was already checked (readable, finite) before the first write."""

    specs: list[TensorSpec]
    stream: TensorStream
    tensors_checked: bool


def check_tensor(name: str, tensor: object, *, allow_non_finite: bool = False) -> torch.Tensor:
    """``tensor`` if it can be copied into a parameter as it is; else CheckpointError naming it and why."""
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if _is_dtensor(tensor):
        raise CheckpointError(
            f"weight {name!r} is a DTensor (a shard of a distributed tensor, as FSDP2 state_dict() gives); "
            "send tensor.full_tensor() instead"
        )
    if tensor.device.type == "meta":
        raise CheckpointError(f"weight {name!r} is on the meta device: it has no data (materialise it first)")
    if tensor.layout != torch.strided:
        raise CheckpointError(f"weight {name!r} has layout {tensor.layout}; send a dense tensor (.to_dense())")
    if not allow_non_finite and tensor.is_floating_point() and not all_finite(tensor):
        raise _non_finite(name)
    return tensor


def _non_finite(name: str) -> CheckpointError:
    return CheckpointError(
        f"weight {name!r} holds NaN or Inf values; fix the source, or pass allow_non_finite=True to write it"
    )


def tensor_source(pairs: list[tuple[str, object]], *, allow_non_finite: bool = False) -> SourceView:
    """A source held in memory: every tensor checked now, before anything is written."""
    checked = [(name, check_tensor(name, t, allow_non_finite=allow_non_finite)) for name, t in pairs]
    return SourceView(
        [(n, tuple(t.shape), t.dtype) for n, t in checked], lambda select: narrowed(checked, select), True
    )


def describe_source(source: WeightSource, *, allow_non_finite: bool = False) -> SourceView:
    """The source's tensor specs (from the headers only, for files) and a way to stream its tensors."""
    if isinstance(source, StagedWeights):
        staged = source.tensors  # checked, and cut to this rank's parts, when staged
        return SourceView(source.specs, lambda select: iter(staged), True)
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        if not path.exists():
            raise CheckpointError(f"weight source {str(path)!r} does not exist")
        files = checkpoint_files(path) if path.is_dir() else [path]
        return SourceView(safetensors_specs(files), lambda select: iter_safetensors(files, select), False)
    pairs: list[tuple[str, object]] = list(source.items()) if isinstance(source, Mapping) else list(source)
    return tensor_source(pairs, allow_non_finite=allow_non_finite)


def check_source(model: LlamaForCausalLM, specs: Iterable[TensorSpec], *, strict: bool, partial: bool) -> WeightPlan:
    """Checks every tensor (name, shape, dtype, duplicates, coverage) before anything is written.

    Returns the plan: ``plan.targets`` says where each checked name goes.
    """
    plan = WeightPlan(model, strict=strict, partial=partial)
    for name, shape, dtype in specs:
        if name in plan.targets:
            raise CheckpointError(f"tensor {name!r} appears twice in the weight source")
        plan.check(name, shape, dtype)
    plan.finish()
    return plan


def stage_weights(
    model: LlamaForCausalLM,
    source: WeightSource,
    *,
    strict: bool = True,
    partial: bool = False,
    allow_non_finite: bool = False,
) -> StagedWeights:
    """Reads and checks the whole source into host memory; safe to run beside serving (reads only)."""
    view = describe_source(source, allow_non_finite=allow_non_finite)
    plan = check_source(model, view.specs, strict=strict, partial=partial)
    # copy=True: a safetensors tensor is a lazy view of its file (read in the pause, and changed by
    # a rewrite of the file); a caller's tensor may be trained on meanwhile. Staging keeps a snapshot.
    tensors = [(name, tensor.to("cpu", copy=True)) for name, tensor in view.stream(plan.targets.get)]
    if not view.tensors_checked:
        for name, tensor in tensors:
            check_tensor(name, tensor, allow_non_finite=allow_non_finite)
    return StagedWeights(view.specs, tensors, sum(t.numel() * t.element_size() for _, t in tensors))


def apply_weights(
    model: LlamaForCausalLM,
    source: SourceView,
    *,
    strict: bool = True,
    partial: bool = False,
    allow_non_finite: bool = False,
) -> tuple[int, int]:
    """Checks every spec, then writes the streamed tensors in place. Returns (tensors, bytes) written.

    The one write path of every weight change (update_weights, staged or not, and worker extensions
    such as the weight-sync plugin): a spec that fails raises CheckpointError before the source is
    even read. Under tensor parallelism the ranks vote after checking, so a source any rank refuses is
    written on none (every rank writes only its own parts). A streamed tensor holding NaN or Inf (found
    as it is written), or one that fails its other checks or a stream that breaks after the first write,
    raises WeightsLostError (the caller must treat the weights as discarded).
    """
    try:
        plan = check_source(model, source.specs, strict=strict, partial=partial)
    except BaseException:
        model.tp.all_agree(False)
        raise
    if not model.tp.all_agree(True):
        raise CheckpointError(
            "another tensor-parallel rank refused this weight source (its error says why); nothing was written "
            "on any rank"
        )
    # A streamed tensor's values are checked in the pass that writes it (the kernels read each piece back
    # from cache), so a file or a broadcast is read once, not twice.
    check_finite = not (source.tensors_checked or allow_non_finite)
    written = nbytes = 0
    try:
        for name, tensor in source.stream(plan.targets.get):
            target = plan.targets.get(name)
            if target is None:
                continue
            if not source.tensors_checked:
                check_tensor(name, tensor, allow_non_finite=True)
            finite = plan.write(target, tensor, check_finite=check_finite)
            written += 1
            nbytes += tensor.numel() * tensor.element_size()
            if not finite:
                raise _non_finite(name)
    except Exception as exc:
        if written == 0:
            raise
        raise WeightsLostError(
            f"the weight update failed after {written} tensors were written ({exc}); the weights are now a mix, "
            "so the engine serves nothing until a full update_weights or reload_weights succeeds"
        ) from exc
    return written, nbytes
