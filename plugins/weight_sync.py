"""WeightSyncExtension: a trainer pushes new weights into a running engine (RL-style), in place.

Two ways in, both ordered with the model steps because they run on the worker's thread:

- ``load_weights_from_tensors``: the trainer hands tensors over directly: a trainer in the same
  process, or CPU tensors in shared memory (``tensor.share_memory_()``) from a forked one.
- ``init_weight_update_group`` + ``receive_weights``: the trainer broadcasts over a PRIVATE
  torch.distributed process group (gloo; nccl on CUDA). torch.distributed's default group is
  never touched, so an engine inside a training job does not interfere with the job's own.
  Everything binds to 127.0.0.1: the trainer runs on the same host.

Names are Hugging Face checkpoint names (``q_proj`` ...); they go through the model's own name
mapping (fused ``qkv_proj`` / ``gate_up_proj``). Both go through the worker's one weight write
(``Worker.write_weights``): the same check as ``update_weights`` (names, shapes, dtypes, a name
given twice, coverage unless partial) over the whole batch before anything is written or
received, so a bad batch changes nothing; writes with ``copy_`` in place (captured graphs and data
pointers stay valid); and a ``WorkerWeightsReport`` back, from which the engine takes the new
``weights_version`` (outputs carry it) and, after a full push, knows that weights a level-2 sleep
discarded are valid again.

The trainer side needs only :func:`trainer_group`, :func:`weight_metadata`,
:func:`broadcast_weights` and :func:`leave_group` (plain functions, no engine import).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aioengine.errors import AIOEngineError, CheckpointError, WeightsLostError
from aioengine.loopback import LOOPBACK, free_port
from aioengine.messages import WorkerWeightsReport
from aioengine.model.loader import narrowed
from aioengine.model.parallel import group_store, leave_group, make_group
from aioengine.worker.weights import SourceView, tensor_source

__all__ = [
    "LOOPBACK",
    "WeightMeta",
    "WeightSyncExtension",
    "broadcast_weights",
    "free_port",
    "leave_group",
    "trainer_group",
    "weight_metadata",
]

WeightMeta = tuple[str, str, list[int]]
"""``(hf_name, dtype, shape)`` of one broadcast tensor, e.g. ``("lm_head.weight", "float32", [1088, 64])``."""

NamedTensors = Sequence[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]

_LOOPBACK_NAMES = (LOOPBACK, "localhost")


# ---- shared by both sides ----------------------------------------------------------------------------
def _as_pairs(named_tensors: NamedTensors | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype (use e.g. 'float32', 'bfloat16')")
    return dtype


# ---- trainer side -------------------------------------------------------------------------------------
def trainer_group(
    master_port: int, world_size: int, *, backend: str = "gloo", timeout: timedelta = timedelta(seconds=60)
) -> tuple[dist.Store, Any]:
    """Rank 0 of a weight-update group: hosts the TCPStore on ``127.0.0.1:master_port``.

    Blocks until the ``world_size - 1`` engine workers have joined (their
    ``init_weight_update_group`` calls), so start those concurrently. Keep both returned objects
    alive while the group is in use; at the end call :func:`leave_group` (the engine's
    ``close_weight_update_group`` passes the same barrier), then drop both before the process exits.
    """
    store = group_store(master_port, 0, world_size, timeout)
    return store, make_group(store, 0, world_size, backend, timeout)


def weight_metadata(named_tensors: NamedTensors) -> list[WeightMeta]:
    """What ``receive_weights`` needs to know before the broadcast: names, dtypes, shapes, in order."""
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in _as_pairs(named_tensors)]


def broadcast_weights(group: Any, named_tensors: NamedTensors, src: int = 0) -> list[WeightMeta]:
    """Broadcasts each tensor from rank ``src``, in order; returns their metadata.

    The receivers must call ``receive_weights`` with the same metadata (``weight_metadata`` gives
    it before you start). With nccl the tensors must be on the trainer's CUDA device.
    """
    pairs = _as_pairs(named_tensors)
    for _, tensor in pairs:
        group.broadcast(tensor.detach().contiguous(), src).wait()
    return weight_metadata(pairs)


# ---- engine side --------------------------------------------------------------------------------------
def _refused(exc: CheckpointError, partial: bool) -> CheckpointError:
    full = "" if partial else " (a full update, partial=False)"
    return CheckpointError(f"weight update refused{full}: {exc}; nothing was written")


class WeightSyncExtension:
    """Worker mixin: receive weights from a trainer, in place, between model steps.

    Mixed into a ``Worker`` (it calls ``write_weights`` and reads ``device`` / ``rank`` of its host).
    """

    def __init__(self) -> None:
        super().__init__()
        self._weight_sync_group: tuple[dist.Store, Any, str] | None = None
        self._weight_sync_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def load_weights_from_tensors(
        self, named_tensors: NamedTensors, partial: bool = True, allow_non_finite: bool = False
    ) -> WorkerWeightsReport:
        """Writes ``[(hf_name, tensor)]`` (or a dict) into the model; returns the worker's report.

        ``partial=False`` also requires every parameter to be covered. Every name, shape and dtype,
        and every tensor's data (materialised, dense, finite unless ``allow_non_finite``; a DTensor
        shard is refused) is checked first; a bad batch raises ``CheckpointError`` naming the tensor
        and writes nothing.
        """
        try:
            source = tensor_source(list(_as_pairs(named_tensors)), allow_non_finite=allow_non_finite)
            return self.write_weights(source, partial=partial)  # type: ignore[attr-defined,no-any-return]
        except WeightsLostError:
            raise
        except CheckpointError as exc:
            raise _refused(exc, partial) from exc

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 60.0,
    ) -> None:
        """Joins the trainer's group (``trainer_group``); blocks until every rank is in.

        ``rank`` is the group rank of the engine's worker 0; worker ``r`` joins as ``rank + r``
        (the same arguments go to every worker). The worker's thread, and so the engine's steps,
        waits meanwhile, at most ``timeout_s``.
        """
        if master_address not in _LOOPBACK_NAMES:
            raise AIOEngineError(
                f"weight sync binds to {LOOPBACK} only, so the trainer must run on this host; "
                f"got master_address={master_address!r}"
            )
        if self._weight_sync_group is not None:
            raise AIOEngineError("a weight update group is already open; call close_weight_update_group first")
        if backend == "nccl" and self.device.type != "cuda":  # type: ignore[attr-defined]
            raise AIOEngineError("backend 'nccl' needs the engine on a CUDA device; use backend='gloo'")
        timeout = timedelta(seconds=timeout_s)
        group_rank = rank + self.rank  # type: ignore[attr-defined]
        store = group_store(master_port, group_rank, world_size, timeout)
        group = make_group(store, group_rank, world_size, backend, timeout)
        self._weight_sync_group = (store, group, backend)

    def receive_weights(
        self, metadata: Sequence[WeightMeta], src: int = 0, partial: bool = True
    ) -> WorkerWeightsReport:
        """Receives the tensors ``metadata`` describes, in its order, writing each in place.

        Names and shapes are checked against the model before anything is received: a bad batch is
        still received (so the trainer's broadcast completes) but dropped, and ``CheckpointError``
        names the tensor. Each tensor's data is checked (finite) as it is written: one that fails
        raises ``WeightsLostError`` (the engine then serves nothing until a full write). Peak extra
        memory is one tensor. Returns the worker's report.
        """
        state = self._weight_sync_group
        if state is None:
            raise AIOEngineError("no weight update group; call init_weight_update_group first")
        _, group, backend = state
        specs = [(name, _dtype(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in metadata]
        on = self.device if backend == "nccl" else torch.device("cpu")  # type: ignore[attr-defined]
        buffers = self._receive_buffers(on, max((math.prod(s) * d.itemsize for _, d, s in specs), default=0))

        def received() -> Iterator[tuple[str, torch.Tensor]]:
            # Tensor i + 1 is received (by the backend's own threads or stream) while the write checks
            # and copies tensor i, into the other of two buffers: the write takes each tensor before
            # it asks for the next, so a buffer is free again by the time tensor i + 2 reuses it.
            pending: tuple[str, torch.Tensor, Any] | None = None
            for i, (name, dtype, shape) in enumerate(specs):
                buf = buffers[i % 2][: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                work = group.broadcast(buf, src)
                if pending is not None:
                    pending[2].wait()
                    yield pending[0], pending[1]
                pending = (name, buf, work)
            if pending is not None:
                pending[2].wait()
                yield pending[0], pending[1]

        incoming = received()  # one stream: what a failed write left unread is drained from it below
        source = SourceView(
            [(n, s, d) for n, d, s in specs], lambda select: narrowed(incoming, select), tensors_checked=False
        )
        try:
            return self.write_weights(source, partial=partial)  # type: ignore[attr-defined,no-any-return]
        except CheckpointError as exc:
            # Still take the rest of the broadcast (and drop it), so the trainer does not hang and the
            # group stays usable.
            for _ in incoming:
                pass
            if isinstance(exc, WeightsLostError):
                raise
            raise _refused(exc, partial) from exc

    def _receive_buffers(self, device: torch.device, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two byte buffers of at least ``nbytes`` for ``receive_weights``. On CPU they are kept for the next
        push (fresh host memory costs a page fault per 4 KiB the first time it is written: about 0.5 s for
        0.5 GB here, every push); on CUDA the caching allocator keeps the memory anyway, so none is held."""
        kept = self._weight_sync_buffers
        if kept is not None and kept[0].device == device and kept[0].numel() >= nbytes:
            return kept
        pair = (
            torch.empty(nbytes, dtype=torch.uint8, device=device),
            torch.empty(nbytes, dtype=torch.uint8, device=device),
        )
        self._weight_sync_buffers = pair if device.type == "cpu" else None
        return pair

    def close_weight_update_group(self) -> None:
        """Leaves the group and drops its store connection; safe to call when none is open."""
        self._weight_sync_buffers = None
        state, self._weight_sync_group = self._weight_sync_group, None
        if state is not None:
            leave_group(state[1])  # the trainer's leave_group passes the same barrier
