"""MultiprocExecutor: each worker rank lives in a process of its own, driven from the engine process.

The engine process drives: it sends every call (steps and RPCs) to every rank's process, in the order
they were submitted, and one reader thread per rank settles the calls' futures as replies come back.
The forward runs under the worker process's own interpreter lock, so the event loop never waits for
it. A driver in the engine process keeps one path for every rank and one place that knows what is in
flight, which is what a dead rank needs to fail everything at once. With ``tensor_parallel_size > 1``
the ranks also meet among themselves (``aioengine.model.parallel``: a private gloo / NCCL group whose
store rank 0 hosts on 127.0.0.1, at the port the executor hands every rank); the step's output is rank
0's, which samples for the group. A rank that hangs (in a collective its peers left, or anywhere) never
answers its step: a watchdog thread fails the executor once a step outlives
``parallel.step_timeout_s``, and kills the ranks that did not answer.

On the wire, one message per call: ``(call_id, method, args, kwargs)``, ``method`` being a worker
method name or a cloudpickled callable taking the worker first (``None`` asks the process to stop);
one reply per call: ``(call_id, ok, result or exception)``. Data is plain pickle (cloudpickle only
where plain pickle cannot, e.g. a lambda inside the arguments). A model step keeps that shape: the
call of ``execute_and_sample``, whose one argument is a ``StepMessage`` (``aioengine.worker.step_wire``)
rather than the ``SchedulerOutput``: the step less what the worker process holds from the step before
(block ids appended, not whole block tables), so a step weighs the same at any context length. That
argument's type is the marker: the worker process decodes it into the ``SchedulerOutput`` before the
call. Every rank gets every step, so all decoders hold the same; the encoder moves on only once a
message is in the pipes. Each rank has two lanes, a pipe each: the step lane serves steps and RPCs
one at a time, in order; the aside lane serves ``run_aside`` on a second thread of the worker
process. Messages go out through one writer thread per lane, so a large argument never blocks the
event loop on a full pipe.

A worker process that dies is seen at once (its pipes close, its sentinel becomes ready): every call
in flight and every later one fails with ``EngineDeadError`` naming the rank and how it ended. Worker
processes never outlive the engine process: they are daemons, they exit when their pipes close (the
aside lane watches for that even while the step lane runs a long call), and ``shutdown`` terminates,
then kills, a process that does not stop when asked.

Processes are started with ``spawn`` (never fork a process that holds torch threads), so, as with any
``spawn`` program, a script that starts an engine at import time needs an ``if __name__ == "__main__":``
guard: the worker process imports the main module again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

import cloudpickle  # type: ignore[import-untyped]

from aioengine.errors import EngineDeadError
from aioengine.executor.base import Executor, execute_and_sample
from aioengine.executor.thread import _bridge
from aioengine.loopback import LOOPBACK, free_port
from aioengine.messages import ModelRunnerOutput, SchedulerOutput
from aioengine.worker.process import dumps, worker_main
from aioengine.worker.step_wire import StepEncoder

logger = logging.getLogger(__name__)

STOP_SECONDS = 30.0
"""How long ``shutdown`` waits for a worker process to stop when asked, before it terminates it."""
_KILL_SECONDS = 5.0
"""How long a terminated (then killed) process may take to go."""
_STEP: bytes = cloudpickle.dumps(execute_and_sample)
"""The step's callable on the wire, pickled once (by reference: the worker process imports it)."""


# ---- the engine process ----------------------------------------------------------------------------------
@dataclass(eq=False)
class _Lane:
    """One pipe to a worker process: calls leave in order through its writer thread, and are answered in order."""

    conn: Connection
    outbox: queue.SimpleQueue[bytes | None] = field(default_factory=queue.SimpleQueue)
    pending: dict[int, concurrent.futures.Future[Any]] = field(default_factory=dict)
    """Calls sent and not answered yet, oldest first."""
    writer: threading.Thread | None = None


@dataclass(eq=False)
class _Rank:
    rank: int
    process: BaseProcess
    step: _Lane
    aside: _Lane
    reader: threading.Thread | None = None
    reaping: threading.Lock = field(default_factory=threading.Lock)
    """Held around every join and liveness check: multiprocessing's waitpid bookkeeping is not thread-safe (two
    threads joining at once can leave one believing a reaped process still runs)."""

    def join(self, timeout: float) -> None:
        with self.reaping:
            self.process.join(timeout)

    def is_alive(self) -> bool:
        with self.reaping:
            return self.process.is_alive()

    @property
    def lanes(self) -> tuple[_Lane, _Lane]:
        return self.step, self.aside


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


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Marks a rank's error as seen: the first one is raised to the caller, the others need no log."""
    if not future.cancelled():
        future.exception()


class MultiprocExecutor(Executor):
    """One worker process per rank (``spawn``), driven from the engine process over pipes."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.world_size = config.parallel.tensor_parallel_size
        self.step_timeout = float(config.parallel.step_timeout_s)
        """A step that has not come back from every rank after this long means a hung rank: the executor dies."""
        self._lock = threading.Lock()
        """Guards the lanes' pending calls and the two flags below (the reader threads settle calls)."""
        self._closed = False
        self._dead: str | None = None
        """Why the executor cannot serve any more: a worker process ended while it was running."""
        self._call_ids = itertools.count()
        self._overdue: dict[asyncio.Future[Any], tuple[str, float]] = {}
        """Calls whose caller timed out while they still run, with their name and when."""
        self._ranks: list[_Rank] = []
        self._started = False
        """Every worker was built: a process that ends before that most likely could not start at all."""
        self._steps: dict[int, float] = {}
        """Steps sent and not answered by every rank yet: call id -> when sent (the watchdog's view)."""
        self._step_wire = StepEncoder()
        """Turns each step into what changed since the one before (what every rank's decoder holds)."""
        self._wake_watchdog = threading.Event()
        context = multiprocessing.get_context("spawn")
        try:
            for rank in range(self.world_size):
                self._start_rank(context, rank)
            # Where the ranks of a tensor-parallel model meet (rank 0 hosts the group's store); on this host only.
            meeting = f"tcp://{LOOPBACK}:{free_port()}" if self.world_size > 1 else None
            # Every worker is built in its own process (device set-up and torch threads are per process).
            inits = [
                self._send("step", "init_worker", (config, r.rank, meeting), {}, "init_worker", [r])
                for r in self._ranks
            ]
            for [future] in inits:
                future.result()
            self._started = True
        except BaseException:
            self.shutdown()
            raise
        self._watchdog = threading.Thread(target=self._watch_steps, name="aioengine-mp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def processes(self) -> list[BaseProcess]:
        """The worker processes, by rank."""
        return [r.process for r in self._ranks]

    @property
    def pids(self) -> list[int | None]:
        return [r.process.pid for r in self._ranks]

    def _start_rank(self, context: SpawnContext, rank: int) -> None:
        step, step_child = context.Pipe()
        aside, aside_child = context.Pipe()
        process = context.Process(
            target=worker_main, args=(rank, step_child, aside_child), name=f"aioengine-worker-{rank}", daemon=True
        )
        try:
            process.start()
        except BaseException:
            step.close()
            aside.close()
            raise
        finally:
            step_child.close()  # the child holds its own ends now; without ours, its death closes the pipes
            aside_child.close()
        worker = _Rank(rank, process, _Lane(step), _Lane(aside))
        self._ranks.append(worker)
        for name, lane in (("step", worker.step), ("aside", worker.aside)):
            lane.writer = threading.Thread(
                target=_write, args=(lane,), name=f"aioengine-mp-{name}-writer-{rank}", daemon=True
            )
            lane.writer.start()
        worker.reader = threading.Thread(
            target=self._read, args=(worker,), name=f"aioengine-mp-reader-{rank}", daemon=True
        )
        worker.reader.start()

    # ---- sending ---------------------------------------------------------------------------------------
    def _send(
        self,
        lane: str,
        method: str | bytes | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str,
        ranks: list[_Rank] | None = None,
        force: bool = False,
        watched: bool = False,
    ) -> list[concurrent.futures.Future[Any]]:
        """Sends one call to every rank (or to ``ranks``), pickled once, behind the calls already sent on
        that lane. Refused once the executor is dead or shut down, unless ``force`` (the stop message).
        A ``watched`` call (a step) that is not answered by every rank within ``step_timeout`` kills the
        executor (``_watch_steps``)."""
        call_id = next(self._call_ids)
        try:
            data = dumps((call_id, method, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"{name!r}: its arguments cannot be sent to a worker process ({exc}); pass data that pickles "
                "(a path, a dict of tensors, a list rather than an iterator)"
            ) from exc
        futures: list[concurrent.futures.Future[Any]] = []
        with self._lock:
            if not force:
                if self._dead is not None:
                    raise EngineDeadError(self._dead)
                if self._closed:
                    raise EngineDeadError("the executor is shut down; create a new engine")
            for rank in self._ranks if ranks is None else ranks:
                target = rank.step if lane == "step" else rank.aside
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                target.pending[call_id] = future
                target.outbox.put(data)
                futures.append(future)
            if watched:
                self._steps[call_id] = time.monotonic()
                self._wake_watchdog.set()
        if watched:
            answered = functools.partial(self._step_answered, call_id)
            for future in futures:
                future.add_done_callback(answered)
        return futures

    def _call(
        self,
        lane: str,
        method: str | Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        watched: bool = False,
    ) -> tuple[str, list[asyncio.Future[Any]]]:
        wire: str | bytes
        if isinstance(method, str):
            name, wire = method, method
        else:
            name = getattr(method, "__qualname__", repr(method))
            wire = _STEP if method is execute_and_sample else _dumps_callable(method, name)
        return name, [_bridge(f) for f in self._send(lane, wire, args, kwargs, name, watched=watched)]

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        name, futures = self._call("step", method, args, kwargs or {})
        for future in futures:
            future.add_done_callback(_retrieve)
        # asyncio.wait, not wait_for: a timeout must not cancel the futures, which track the calls still
        # running (overdue_calls) until their replies come.
        done, running = await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        for future in futures:
            if future in done and (error := future.exception()) is not None:
                raise error
        if running:
            since = time.monotonic()
            for future in running:
                self._overdue[future] = (name, since)
                future.add_done_callback(self._overdue.pop)
            raise TimeoutError(
                f"collective_rpc {name!r} timed out after {timeout}s; it still runs in the worker process and "
                "model steps wait behind it until it returns"
            )
        results = [future.result() for future in futures]
        return results[unique_reply_rank] if unique_reply_rank is not None else results

    def overdue_calls(self) -> list[str]:
        now = time.monotonic()
        return [f"{name!r} (timed out, running {now - since:.1f}s)" for name, since in self._overdue.values()]

    def submit_step(self, scheduler_output: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        # Sent right here, behind every call submitted before it; rank 0's output is the step's.
        encoded = self._step_wire.encode(scheduler_output)
        _, futures = self._call("step", execute_and_sample, (encoded.message,), {}, watched=True)
        self._step_wire.commit(encoded)  # only now: a step that was refused leaves every decoder where it was
        for future in futures:
            # A failing rank's error reaches the caller through rank 0's, and a step queued behind one that
            # failed is never awaited: neither is an unretrieved error.
            future.add_done_callback(_retrieve)
        output: asyncio.Future[ModelRunnerOutput] = futures[0]
        return output

    async def run_aside(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        _, futures = self._call("aside", method, args, {})
        return list(await asyncio.gather(*futures))

    # ---- watching for a hung rank ------------------------------------------------------------------------
    def _step_answered(self, call_id: int, _: object = None) -> None:
        with self._lock:
            if call_id in self._steps and not any(call_id in r.step.pending for r in self._ranks):
                del self._steps[call_id]

    def _watch_steps(self) -> None:
        """Fails the executor when a step outlives ``step_timeout`` on some rank (a rank that hangs, in a
        collective its peers left or anywhere else, never answers; a rank that dies is seen by its reader)."""
        while True:
            with self._lock:
                if self._closed or self._dead is not None:
                    return
                oldest = min(self._steps.items(), key=lambda item: item[1], default=None)
                late = None
                if oldest is not None and time.monotonic() - oldest[1] > self.step_timeout:
                    late = [r for r in self._ranks if oldest[0] in r.step.pending]
                    self._dead = (
                        f"worker rank(s) {[r.rank for r in late]} did not finish a model step within "
                        f"parallel.step_timeout_s={self.step_timeout:g}s (hung); the engine cannot serve without "
                        "them: create a new engine"
                    )
            if late is not None:
                logger.error("%s", self._dead)
                self._fail_pending()
                for rank in late:  # a hung process holds its device and cores: it is gone now
                    rank.process.kill()
                return
            # Until the oldest step's deadline, or until a step is sent (or the executor closes).
            self._wake_watchdog.wait(None if oldest is None else oldest[1] + self.step_timeout - time.monotonic())
            self._wake_watchdog.clear()

    # ---- receiving -------------------------------------------------------------------------------------
    def _read(self, worker: _Rank) -> None:
        """The rank's reader thread: settles calls as replies come until the process ends, then fails
        whatever is left (also if the thread itself breaks: a call must never wait for nothing)."""
        try:
            self._receive(worker)
        except Exception:
            logger.exception("the reader of worker rank %d failed", worker.rank)
        finally:
            worker.join(_KILL_SECONDS)
            self._lost(worker)

    def _receive(self, worker: _Rank) -> None:
        lanes = {lane.conn: lane for lane in worker.lanes}
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

    def _settle(self, worker: _Rank, lane: _Lane, data: bytes) -> None:
        try:
            call_id, ok, value = pickle.loads(data)
        except Exception as exc:
            call_id, ok = None, False
            value = RuntimeError(f"a reply of worker rank {worker.rank} cannot be read in the engine process: {exc}")
        with self._lock:
            if call_id is None:  # a message the worker could not read: the oldest call of the lane
                call_id = next(iter(lane.pending), None)
            future = lane.pending.pop(call_id, None) if call_id is not None else None
        if future is None:
            return  # failed already (the executor shut down meanwhile)
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _lost(self, worker: _Rank) -> None:
        """A worker process ended: unless the executor stopped it, the executor is dead. Either way every
        call still pending on any rank fails (the ranks of one model cannot go on without one of them)."""
        with self._lock:
            if not self._closed and self._dead is None:
                process = worker.process
                self._dead = (
                    f"worker rank {worker.rank} (pid {process.pid}) {_how_it_ended(process.exitcode)}; the engine "
                    "cannot serve without it: create a new engine"
                )
                if not self._started:
                    self._dead += (
                        " (a script that starts an engine when it is imported needs an `if __name__ == "
                        "'__main__':` guard: worker processes are spawned, and import the main module again)"
                    )
                logger.error("%s", self._dead)
        self._fail_pending()

    def _fail_pending(self) -> None:
        with self._lock:
            reason = self._dead or "the executor is shut down; create a new engine"
            orphans = [f for rank in self._ranks for lane in rank.lanes for f in lane.pending.values()]
            for rank in self._ranks:
                for lane in rank.lanes:
                    lane.pending.clear()
        for future in orphans:
            future.set_exception(EngineDeadError(reason))

    # ---- stopping --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake_watchdog.set()
        deadline = time.monotonic() + STOP_SECONDS
        alive = [r for r in self._ranks if r.is_alive()]
        stops = self._send("step", None, (), {}, "shutdown", alive, force=True) if alive else []
        for future in stops:  # behind the calls already sent: a call that never returns holds it
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                logger.warning("a worker process did not stop within %.0fs; terminating it", STOP_SECONDS)
            except EngineDeadError:
                pass  # the executor died (a rank ended or hung, as logged then): the processes are reaped below
            except Exception:  # shutdown must complete even if a worker is broken
                logger.exception("a worker process failed to shut down cleanly")
        for worker in self._ranks:
            _reap(worker, deadline)
        for worker in self._ranks:
            for lane in worker.lanes:
                lane.outbox.put(None)
            for thread in (worker.step.writer, worker.aside.writer, worker.reader):
                if thread is not None:
                    thread.join(_KILL_SECONDS)
            for lane in worker.lanes:
                lane.conn.close()
        self._fail_pending()  # calls of a process whose reader did not end in time


def _dumps_callable(method: Callable[..., Any], name: str) -> bytes:
    try:
        data: bytes = cloudpickle.dumps(method, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"collective_rpc {name!r}: the callable cannot be sent to a worker process ({exc})") from exc
    return data


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
