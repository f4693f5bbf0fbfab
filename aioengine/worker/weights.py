"""Hot weight swap on the worker: check the whole source first, then write in place tensor by tensor.

A source is a safetensors file or directory, a ``{name: tensor}`` mapping, an iterable of
``(name, tensor)`` pairs, or :class:`StagedWeights` (already read and checked). Names are the
checkpoint's (HF) names; fused q/k/v and gate/up are mapped by the model. Nothing is written until
every tensor has passed, so a bad source changes nothing. Writes use ``copy_`` into the existing
parameters: addresses (and captured CUDA graphs) stay valid, and peak extra memory is one tensor
when streaming from files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from aioengine.errors import CheckpointError
from aioengine.model.llama import LlamaForCausalLM
from aioengine.model.loader import TensorSpec, WeightPlan, checkpoint_files, iter_safetensors, safetensors_specs


@dataclass(slots=True)
class StagedWeights:
    """A source read into host memory and checked against the model (``stage=True``)."""

    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int


WeightSource = str | os.PathLike[str] | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | StagedWeights
TensorStream = Callable[[], Iterator[tuple[str, torch.Tensor]]]
"""Yields the source's ``(name, tensor)`` pairs when called, lazily where it can (files, a broadcast)."""


def shard_for_rank(name: str, tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's part of a full checkpoint tensor: THE place tensor parallelism fills in."""
    if world_size == 1:
        return tensor
    raise NotImplementedError("tensor-parallel weight sharding is not implemented yet")


def describe_source(source: WeightSource) -> tuple[list[TensorSpec], TensorStream]:
    """The source's tensor specs (without reading data, for files) and a way to stream its tensors."""
    if isinstance(source, StagedWeights):
        pairs = source.tensors
    elif isinstance(source, str | os.PathLike):
        path = Path(source)
        if not path.exists():
            raise CheckpointError(f"weight source {str(path)!r} does not exist")
        files = checkpoint_files(path) if path.is_dir() else [path]
        return safetensors_specs(files), lambda: iter_safetensors(files)
    elif isinstance(source, Mapping):
        pairs = list(source.items())
    else:
        pairs = list(source)
    for name, tensor in pairs:
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    return [(n, tuple(t.shape), t.dtype) for n, t in pairs], lambda: iter(pairs)


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
    model: LlamaForCausalLM, source: WeightSource, *, strict: bool = True, partial: bool = False
) -> StagedWeights:
    """Reads and checks the whole source into host memory; safe to run beside serving (reads only)."""
    specs, stream = describe_source(source)
    check_source(model, specs, strict=strict, partial=partial)
    # copy=True: a safetensors tensor is a lazy view of its file (read in the pause, and changed by
    # a rewrite of the file); a caller's tensor may be trained on meanwhile. Staging keeps a snapshot.
    tensors = [(name, tensor.to("cpu", copy=True)) for name, tensor in stream()]
    return StagedWeights(tensors, sum(t.numel() * t.element_size() for _, t in tensors))


def apply_weights(
    model: LlamaForCausalLM,
    specs: Iterable[TensorSpec],
    stream: TensorStream,
    *,
    strict: bool = True,
    partial: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[int, int]:
    """Checks every spec, then writes the streamed tensors in place. Returns (tensors, bytes) written.

    The one write path of every weight change (update_weights, staged or not, and worker extensions
    such as the weight-sync plugin): a spec that fails raises CheckpointError before ``stream`` is
    even called.
    """
    plan = check_source(model, specs, strict=strict, partial=partial)
    written = nbytes = 0
    for name, tensor in stream():
        target = plan.targets.get(name)
        if target is None:
            continue
        shard = shard_for_rank(name, tensor, rank, world_size)
        plan.destination(target).copy_(shard)
        written += 1
        nbytes += shard.numel() * shard.element_size()
    return written, nbytes
