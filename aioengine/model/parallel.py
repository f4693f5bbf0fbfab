"""Tensor parallelism: the group of ranks that share one model, and the collectives its layers call.

Every rank of a tensor-parallel model holds a slice of each sharded weight (by heads for attention, by
rows of the intermediate size for the MLP, by vocabulary rows for the embedding and the LM head) and
meets the other ranks at fixed points of the forward: an all-reduce after each row-parallel projection
and after the embedding, an all-gather of the logits. Ranks run the same collectives in the same order,
so every rank runs every step (the executor sends each step to all of them).

The group is a PRIVATE torch.distributed process group over a TCP store on 127.0.0.1 (gloo on CPU,
NCCL on CUDA): torch.distributed's default group is never touched, so an engine inside a training job
(which owns the default group) does not interfere with it, and nothing listens beyond this host.
``TensorParallel()`` with ``size == 1`` is the single-rank case: every collective is a no-op.
"""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aioengine.errors import AIOEngineError
from aioengine.loopback import LOOPBACK
from aioengine.model.tp_layout import partition

_CPU = torch.device("cpu")


def group_store(port: int, rank: int, world_size: int, timeout: timedelta, host: str = LOOPBACK) -> dist.Store:
    """The TCP store of a private group: rank 0 hosts it on ``host:port`` (127.0.0.1 unless the ranks span
    several hosts), the others connect."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = socket.socket()
    try:
        listener.bind((host, port))  # TCPStore alone would listen on every interface
        listener.listen()
    except OSError:
        listener.close()
        raise
    # The store takes the listening socket over (and closes it with itself).
    return dist.TCPStore(
        LOOPBACK, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.detach()
    )


def _gloo_options(timeout: timedelta, host: str) -> Any:
    # torch's stubs name only ProcessGroupGloo.Options, which at run time is Backend.Options; the gloo one is private
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # default: the host's address
    options._timeout = timeout
    return options


def make_group(
    store: dist.Store, rank: int, world_size: int, backend: str, timeout: timedelta, host: str = LOOPBACK
) -> Any:
    """A process group of its own over ``store``; the global default group stays as it is. gloo binds to
    ``host`` (this rank's address on the network the ranks share; 127.0.0.1 on one host)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, _gloo_options(timeout, host))
    if backend == "nccl":
        if not (torch.cuda.is_available() and hasattr(dist, "ProcessGroupNCCL")):
            raise AIOEngineError("backend 'nccl' needs CUDA and a torch built with NCCL; use backend='gloo'")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def leave_group(group: Any) -> None:
    """Leaves a private group: a barrier every member passes, then ``shutdown``.

    The barrier comes first because a peer that tears its sockets down while another still finishes
    makes gloo abort the slower one. Afterwards drop every reference to the group (and its store) while
    the interpreter still runs, in a function's locals rather than a script's globals: ``shutdown`` does
    not stop gloo's worker threads, only the group's destruction joins them, and a worker that lets go
    of its last tensor while Python is finalizing cannot take the GIL, so the process aborts
    ("terminate called without an active exception").
    """
    group.barrier().wait()
    if hasattr(group, "shutdown"):
        group.shutdown()


def parse_init_method(init_method: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (HOST, PORT); ConfigurationError otherwise."""
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    if not init_method.startswith("tcp://") or not host or not port.isdigit():
        from aioengine.errors import ConfigurationError

        raise ConfigurationError(f"distributed_init_method must be 'tcp://HOST:PORT', got {init_method!r}")
    return host, int(port)


@dataclass(slots=True)
class CollectiveStats:
    """What this rank's collectives cost: how many, and the seconds spent waiting for them (on CPU that is the
    whole collective; on CUDA only the launch unless something synchronises)."""

    calls: int = 0
    seconds: float = 0.0

    def timed(self, work: Any) -> None:
        start = time.perf_counter()
        work.wait()
        self.seconds += time.perf_counter() - start
        self.calls += 1


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """This rank's place in its tensor-parallel group, and the group's collectives (no-ops at size 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    """The process group (``ProcessGroupGloo`` / ``ProcessGroupNCCL``); None at size 1."""
    device: torch.device = _CPU
    """Where the group's tensors live: the CPU for gloo, this rank's GPU for NCCL."""
    store: Any = None
    """Kept alive with the group (rank 0 hosts it)."""
    stats: CollectiveStats = field(default_factory=lambda: CollectiveStats())

    @classmethod
    def connect(
        cls,
        rank: int,
        size: int,
        init_method: str,
        device: torch.device,
        timeout: timedelta = timedelta(seconds=300),
        host: str = LOOPBACK,
    ) -> TensorParallel:
        """Joins the group at ``init_method`` (``tcp://HOST:PORT``, where rank 0 hosts the group's store): blocks
        until all ``size`` ranks are in. ``host`` is this rank's own address for gloo (the meeting host on one
        machine). ``timeout`` also bounds every collective: a rank whose peer hangs fails, never waits forever.
        """
        if size == 1:
            return cls(device=device)
        store_host, port = parse_init_method(init_method)
        store = group_store(port, rank, size, timeout, store_host)
        backend = "nccl" if device.type == "cuda" else "gloo"
        return cls(rank, size, make_group(store, rank, size, backend, timeout, host), device, store)

    def partition(self, total: int, what: str) -> int:
        """``total / size``; UnsupportedModelError naming ``what`` when it does not divide."""
        return partition(total, self.size, what)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place; returns it."""
        if self.size > 1:
            self.stats.timed(self.group.allreduce([x]))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x``, concatenated along ``dim`` in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.stats.timed(self.group.allgather([parts], [x]))
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s ``x`` on every rank (in place); returns it."""
        if self.size > 1:
            self.stats.timed(self.group.broadcast(x, src))
        return x

    def all_agree(self, ok: bool) -> bool:
        """True only when ``ok`` on every rank: the vote of a change that must happen everywhere or nowhere."""
        if self.size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # the stubs mix ReduceOp and its enum
        self.group.allreduce([flag], options).wait()
        return bool(flag.item())

    def barrier(self) -> None:
        if self.size > 1:
            self.group.barrier().wait()

    def close(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Leaves the group, after a barrier so that no rank tears its sockets down while a peer still reads
        from them (gloo can abort the slower process then). A peer that is gone or hung only costs
        ``timeout``. Safe on a single rank."""
        if self.size == 1:
            return
        options = dist.BarrierOptions()
        options.timeout = timeout
        with contextlib.suppress(RuntimeError):  # a peer is gone: nothing left to wait for
            self.group.barrier(options).wait()
        if hasattr(self.group, "shutdown"):
            self.group.shutdown()


SINGLE = TensorParallel()
"""The single-rank group."""
