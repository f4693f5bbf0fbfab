"""MultiprocExecutor: each worker rank lives in a process of its own, driven from the engine process.

The driver, the wire format and the step watchdog are ``RemoteExecutor``'s (``aioengine.executor.remote``);
what lives here is the processes and their pipes. Each rank has a spawned worker process
(``aioengine.worker.process``), whose forward runs under its own interpreter lock, and two pipes, one per
lane: the step lane's calls run on the process's main thread, the aside lane's on a second one. Messages go
out through one writer thread per lane, so a large argument never blocks the event loop on a full pipe, and
one reader thread per rank settles the calls as replies come back; a reply the engine process cannot read
answers the oldest call of its lane. With ``tensor_parallel_size > 1`` the ranks also meet among themselves
(``aioengine.model.parallel``: a private gloo / NCCL group whose store rank 0 hosts on 127.0.0.1, at the port
the executor hands every rank).

A worker process that dies is seen at once (its pipes close, its sentinel becomes ready): every call
in flight and every later one fails with ``EngineDeadError`` naming the rank and how it ended. Worker
processes never outlive the engine process: they are daemons, they exit when their pipes close (the
aside lane watches for that even while the step lane runs a long call), and ``shutdown`` terminates,
then kills, a process that does not stop when asked; the watchdog kills a hung one.

Processes are started with ``spawn`` (never fork a process that holds torch threads), so, as with any
``spawn`` program, a script that starts an engine at import time needs an ``if __name__ == "__main__":``
guard: the worker process imports the main module again.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import ClassVar

from aioengine.executor.remote import LANES, Rank, RemoteExecutor
from aioengine.loopback import LOOPBACK, free_port
from aioengine.worker.process import worker_main

logger = logging.getLogger(__name__)

_KILL_SECONDS = 5.0
"""How long a terminated (then killed) process may take to go."""


@dataclass(eq=False)
class _Lane:
    """One pipe to a worker process: calls leave in order through its writer thread, and are answered in order."""

    conn: Connection
    outbox: queue.SimpleQueue[bytes | None] = field(default_factory=queue.SimpleQueue)
    writer: threading.Thread | None = None


@dataclass(eq=False)
class _Rank(Rank):
    """A rank's worker process, its pipes and their threads."""

    process: BaseProcess
    lanes: dict[str, _Lane]
    """The rank's pipes, by lane."""
    reader: threading.Thread | None = None
    reaping: threading.Lock = field(default_factory=threading.Lock)
    """Held around every join and liveness check: multiprocessing's waitpid bookkeeping is not thread-safe (two
    threads joining at once can leave one believing a reaped process still runs)."""

    def __str__(self) -> str:
        return f"worker rank {self.rank} (pid {self.process.pid})"

    def join(self, timeout: float) -> None:
        with self.reaping:
            self.process.join(timeout)

    def is_alive(self) -> bool:
        with self.reaping:
            return self.process.is_alive()


def _write(lane: _Lane) -> None:
    while (data := lane.outbox.get()) is not None:
        with contextlib.suppress(OSError, ValueError):  # the process is gone: the reader fails every call
            lane.conn.send_bytes(data)


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its pipes"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode} (its stderr says why)" if exitcode else "exited"


class MultiprocExecutor(RemoteExecutor[_Rank]):
    """One worker process per rank (``spawn``), driven from the engine process over pipes."""

    calls_run_in: ClassVar[str] = "the worker process"
    thread_prefix: ClassVar[str] = "aioengine-mp"

    @property
    def processes(self) -> list[BaseProcess]:
        """The worker processes, by rank."""
        return [r.process for r in self._ranks]

    @property
    def pids(self) -> list[int | None]:
        return [r.process.pid for r in self._ranks]

    def _start_ranks(self) -> str | None:
        context = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            pipes = {lane: context.Pipe() for lane in LANES}
            process = context.Process(
                target=worker_main,
                args=(rank, pipes["step"][1], pipes["aside"][1]),
                name=f"aioengine-worker-{rank}",
                daemon=True,
            )
            try:
                process.start()
            except BaseException:
                for ours, _ in pipes.values():
                    ours.close()
                raise
            finally:
                # The child holds its own ends now; without our copies of them, its death closes the pipes.
                for _, theirs in pipes.values():
                    theirs.close()
            worker = _Rank(rank, process, {lane: _Lane(ours) for lane, (ours, _) in pipes.items()})
            self._ranks.append(worker)
            for name, lane in worker.lanes.items():
                lane.writer = threading.Thread(
                    target=_write, args=(lane,), name=f"{self.thread_prefix}-{name}-writer-{rank}", daemon=True
                )
                lane.writer.start()
            worker.reader = threading.Thread(
                target=self._read, args=(worker,), name=f"{self.thread_prefix}-reader-{rank}", daemon=True
            )
            worker.reader.start()
        # Where the ranks of a tensor-parallel model meet (rank 0 hosts the group's store); on this host only.
        return f"tcp://{LOOPBACK}:{free_port()}" if self.world_size > 1 else None

    def _post(self, lane: str, call_id: int, data: bytes, ranks: list[_Rank]) -> Callable[[], None] | None:
        for rank in ranks:
            rank.lanes[lane].outbox.put(data)
        return None

    def _kill(self, rank: _Rank) -> None:
        rank.process.kill()

    # ---- receiving (the rank's reader thread) ----------------------------------------------------------
    def _read(self, worker: _Rank) -> None:
        """Settles calls as replies come until the process ends, then fails whatever is left (also if the
        thread itself breaks: a call must never wait for nothing)."""
        try:
            self._receive(worker)
        except Exception:
            logger.exception("the reader of worker rank %d failed", worker.rank)
        finally:
            worker.join(_KILL_SECONDS)
            self._ended(worker)

    def _receive(self, worker: _Rank) -> None:
        lanes = {lane.conn: name for name, lane in worker.lanes.items()}
        sentinel = worker.process.sentinel
        ended = False
        while not ended:
            for ready in wait([*lanes, sentinel]):
                if not isinstance(ready, Connection):  # the sentinel: the process ended
                    ended = True
                    continue
                try:
                    self._settle(worker, lanes[ready], ready.recv_bytes())
                except (EOFError, OSError):
                    ended = True
        for conn, lane in lanes.items():  # replies written just before the process ended
            try:
                while conn.poll():
                    self._settle(worker, lane, conn.recv_bytes())
            except (EOFError, OSError):
                pass

    def _ended(self, worker: _Rank) -> None:
        hint = ""
        if not self._started:
            hint = (
                " (a script that starts an engine when it is imported needs an `if __name__ == '__main__':` "
                "guard: worker processes are spawned, and import the main module again)"
            )
        self._lost(f"{worker} {_how_it_ended(worker.process.exitcode)}", hint)

    # ---- stopping --------------------------------------------------------------------------------------
    def _ranks_to_stop(self, polite: bool) -> list[_Rank]:
        return [r for r in self._ranks if r.is_alive()]  # a process gone has no reader left to answer

    def _end(self, deadline: float) -> None:
        for worker in self._ranks:
            _reap(worker, deadline)
        for worker in self._ranks:
            for lane in worker.lanes.values():
                lane.outbox.put(None)
            for thread in (*(lane.writer for lane in worker.lanes.values()), worker.reader):
                if thread is not None:
                    thread.join(_KILL_SECONDS)
            for lane in worker.lanes.values():
                lane.conn.close()


def _reap(worker: _Rank, deadline: float) -> None:
    """Waits for the rank's process until ``deadline``, then terminates it, then kills it: it never outlives us."""
    process = worker.process
    worker.join(max(0.0, deadline - time.monotonic()))
    for end in (process.terminate, process.kill):
        if not worker.is_alive():
            return
        logger.warning("worker process %s (pid %s) did not stop; %s", process.name, process.pid, end.__name__)
        end()
        worker.join(_KILL_SECONDS)
    if worker.is_alive():
        logger.error("worker process %s (pid %s) survived SIGKILL", process.name, process.pid)
