"""RemoteExecutor: worker ranks in other processes, driven from the engine process.

The driver that ``MultiprocExecutor`` (a spawned process per rank) and ``RayExecutor`` (a Ray actor per rank)
share. A back end says only how its ranks start, how a call's bytes reach them, how one is killed or seen to
end, how messages name one, and how they stop. The engine process drives: it sends every call (steps and RPCs)
to every rank in the order they were submitted, and settles the calls' futures as the replies come back, so
the event loop never waits for a forward. One driver keeps one path for every rank and one place that knows
what is in flight, which is what a dead rank needs to fail everything at once.

On the wire, one message per call: ``(call_id, method, args, kwargs)``, ``method`` being a worker method name
or a cloudpickled callable taking the worker first (``None`` asks the rank to stop); one reply per call:
``(call_id, ok, result or exception)`` (``aioengine.worker.process`` serves them). Data is plain pickle
(cloudpickle only where plain pickle cannot, e.g. a lambda inside the arguments), pickled once for every rank.
A model step keeps that shape: the call of ``execute_and_sample``, whose one argument is a ``StepMessage``
(``aioengine.worker.step_wire``) rather than the ``SchedulerOutput``: the step less what the rank holds from
the step before (block ids appended, not whole block tables), so a step weighs the same at any context
length. Every rank gets every step, so all decoders hold the same; the encoder moves on only once a message
has left. Each rank has two lanes: the step lane serves steps and RPCs one at a time, in order; the aside lane
serves ``run_aside`` beside it.

A rank that ends fails every call in flight and every later one with ``EngineDeadError`` naming it. A rank
that hangs (in a collective its peers left, or anywhere) never answers its step: a watchdog thread fails the
executor once a step outlives ``parallel.step_timeout_s``, and kills the ranks that did not answer. With
``tensor_parallel_size > 1`` a step's output is rank 0's (it samples for the group) once every rank answered;
a step that fails fails with the error that explains it, a dead or hung rank's before its peers' broken
collectives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import pickle
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import cloudpickle  # type: ignore[import-untyped]

from aioengine.errors import EngineDeadError
from aioengine.executor.base import (
    Executor,
    OverdueCalls,
    bridge,
    call_name,
    execute_and_sample,
    gather_replies,
    retrieve,
)
from aioengine.executor.rank_replies import once_every_rank_answered
from aioengine.messages import ModelRunnerOutput, SchedulerOutput
from aioengine.model.tp_layout import check_checkpoint_split
from aioengine.worker.process import dumps
from aioengine.worker.step_wire import StepEncoder

logger = logging.getLogger(__name__)

STOP_SECONDS = 30.0
"""How long ``shutdown`` waits for a rank to stop when asked, before its back end ends it."""
LANES = ("step", "aside")
"""A rank's lanes: steps and RPCs in order; ``run_aside`` beside them."""
_STEP: bytes = cloudpickle.dumps(execute_and_sample)
"""The step's callable on the wire, pickled once (by reference: the rank imports it)."""


@dataclass(eq=False)
class Rank:
    """One rank as the driver sees it; a back end's record of a rank adds how the rank is reached."""

    rank: int
    pending: dict[str, dict[int, concurrent.futures.Future[Any]]] = field(
        default_factory=lambda: {lane: {} for lane in LANES}, kw_only=True
    )
    """Calls sent and not answered yet, by lane, oldest first."""

    def __str__(self) -> str:
        """How messages name the rank."""
        return f"worker rank {self.rank}"


R = TypeVar("R", bound=Rank)


class RemoteExecutor(Executor, Generic[R]):
    """The driver of ranks that live in other processes; a back end implements the hooks at the bottom."""

    calls_run_in: ClassVar[str]
    """Where a rank's calls run, for messages ("the worker process")."""
    thread_prefix: ClassVar[str]
    """The prefix of the back end's thread names ("aioengine-mp")."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.world_size = config.parallel.tensor_parallel_size
        if self.world_size > 1 and config.model.path is not None:
            check_checkpoint_split(config.model.path, self.world_size)  # before any rank starts: refused at once
        self.step_timeout = float(config.parallel.step_timeout_s)
        """A step that has not come back from every rank after this long means a hung rank: the executor dies."""
        self._lock = threading.Lock()
        """Guards the ranks' pending calls, the steps in flight, ``_closed`` and ``_dead`` (other threads settle
        calls)."""
        self._closed = False
        self._dead: str | None = None
        """Why the executor cannot serve any more: a rank ended or hung while it was running."""
        self._started = False
        """Every rank's worker was built: a rank that ends before that most likely could not start at all."""
        self._call_ids = itertools.count()
        self._overdue = OverdueCalls()
        self._ranks: list[R] = []
        self._steps: dict[int, float] = {}
        """Steps sent and not answered by every rank yet: call id -> when sent (the watchdog's view)."""
        self._step_wire = StepEncoder()
        """Turns each step into what changed since the one before (what every rank's decoder holds)."""
        self._wake_watchdog = threading.Event()
        try:
            meeting = self._start_ranks()
            inits = [
                self._send("step", "init_worker", (config, self._local_rank(r), meeting), {}, "init_worker", [r])
                for r in self._ranks
            ]
            for [future] in inits:
                future.result()
            self._started = True
        except BaseException:
            self.shutdown()
            raise
        self._watchdog = threading.Thread(target=self._watch_steps, name=f"{self.thread_prefix}-watchdog", daemon=True)
        self._watchdog.start()

    # ---- sending ---------------------------------------------------------------------------------------
    def _send(
        self,
        lane: str,
        method: str | bytes | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str,
        ranks: list[R] | None = None,
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
        with self._lock:  # calls leave in the order they were submitted
            if not force:
                if self._dead is not None:
                    raise EngineDeadError(self._dead)
                if self._closed:
                    raise EngineDeadError("the executor is shut down; create a new engine")
            targets = self._ranks if ranks is None else ranks
            futures: list[concurrent.futures.Future[Any]] = []
            for rank in targets:
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                rank.pending[lane][call_id] = future
                futures.append(future)
            then = self._post(lane, call_id, data, targets)
            if watched:
                self._steps[call_id] = time.monotonic()
                self._wake_watchdog.set()
        if then is not None:
            then()
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
        name = call_name(method)
        wire: str | bytes
        if isinstance(method, str):
            wire = method
        else:
            wire = _STEP if method is execute_and_sample else _dumps_callable(method, name)
        futures = [bridge(f) for f in self._send(lane, wire, args, kwargs, name, watched=watched)]
        for future in futures:
            # One rank's error reaches the caller (the first, or the one that explains a step): the others
            # are no unretrieved errors.
            future.add_done_callback(retrieve)
        return name, futures

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        name, futures = self._call("step", method, args, kwargs or {})
        return await gather_replies(futures, name, timeout, unique_reply_rank, self._overdue, f"in {self.calls_run_in}")

    def overdue_calls(self) -> list[str]:
        return self._overdue.describe()

    def submit_step(self, scheduler_output: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        # Sent right here, behind every call submitted before it.
        encoded = self._step_wire.encode(scheduler_output)
        _, futures = self._call("step", execute_and_sample, (encoded.message,), {}, watched=True)
        self._step_wire.commit(encoded)  # only now: a step that was refused leaves every decoder where it was
        step = futures[0] if len(futures) == 1 else once_every_rank_answered(futures)
        step.add_done_callback(retrieve)  # a step queued behind one that failed is never awaited
        return step

    async def run_aside(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        _, futures = self._call("aside", method, args, {})
        return list(await asyncio.gather(*futures))

    # ---- watching for a hung rank ------------------------------------------------------------------------
    def _step_answered(self, call_id: int, _: object = None) -> None:
        with self._lock:
            if call_id in self._steps and not any(call_id in r.pending["step"] for r in self._ranks):
                del self._steps[call_id]

    def _watch_steps(self) -> None:
        """Fails the executor when a step outlives ``step_timeout`` on some rank (a rank that hangs, in a
        collective its peers left or anywhere else, never answers; a rank that ends is seen by its back end)."""
        while True:
            with self._lock:
                if self._closed or self._dead is not None:
                    return
                oldest = min(self._steps.items(), key=lambda item: item[1], default=None)
                late = None
                if oldest is not None and time.monotonic() - oldest[1] > self.step_timeout:
                    late = [r for r in self._ranks if oldest[0] in r.pending["step"]]
                    self._dead = (
                        f"worker rank(s) {[r.rank for r in late]} did not finish a model step within "
                        f"parallel.step_timeout_s={self.step_timeout:g}s (hung); the engine cannot serve without "
                        "them: create a new engine"
                    )
            if late is not None:
                logger.error("%s", self._dead)
                self._fail_pending()
                for rank in late:  # a hung rank holds its device and cores: it is gone now
                    self._kill(rank)
                return
            # Until the oldest step's deadline, or until a step is sent (or the executor closes).
            self._wake_watchdog.wait(None if oldest is None else oldest[1] + self.step_timeout - time.monotonic())
            self._wake_watchdog.clear()

    # ---- receiving (on the back end's threads) ---------------------------------------------------------
    def _settle(self, rank: R, lane: str, data: bytes, call_id: int | None = None) -> None:
        """Settles the call a reply on the wire answers: ``call_id`` when the back end knows it, else the one
        the reply names (a reply that cannot be read, or that answers a message the rank could not read,
        answers the oldest call of its lane)."""
        try:
            replied, ok, value = pickle.loads(data)
        except Exception as exc:
            replied, ok = None, False
            value = RuntimeError(f"a reply of {rank} cannot be read in the engine process: {exc}")
        self._resolve(rank, lane, replied if call_id is None else call_id, ok, value)

    def _resolve(self, rank: R, lane: str, call_id: int | None, ok: bool, value: Any) -> None:
        """Sets the outcome of a call of ``rank``'s ``lane`` (``None``: its oldest)."""
        with self._lock:
            pending = rank.pending[lane]
            if call_id is None:
                call_id = next(iter(pending), None)
            future = pending.pop(call_id, None) if call_id is not None else None
        if future is None:
            return  # failed already (the executor died or shut down meanwhile)
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _lost(self, ended: str, hint: str = "") -> None:
        """A rank ended (``ended`` says which and how): unless the executor stopped it, the executor is dead.
        Either way every call still pending on any rank fails (the ranks of one model cannot go on without
        one of them)."""
        with self._lock:
            if not self._closed and self._dead is None:
                self._dead = f"{ended}; the engine cannot serve without it: create a new engine{hint}"
                logger.error("%s", self._dead)
        self._fail_pending()

    def _fail_pending(self) -> None:
        with self._lock:
            reason = self._dead or "the executor is shut down; create a new engine"
            orphans = [f for rank in self._ranks for pending in rank.pending.values() for f in pending.values()]
            for rank in self._ranks:
                for pending in rank.pending.values():
                    pending.clear()
        for future in orphans:
            future.set_exception(EngineDeadError(reason))

    # ---- stopping --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            polite = self._dead is None
        self._wake_watchdog.set()
        deadline = time.monotonic() + STOP_SECONDS
        asked = self._ranks_to_stop(polite)
        stops = self._send("step", None, (), {}, "shutdown", asked, force=True)
        # Behind the calls sent before: one that never returns holds it.
        for rank, future in zip(asked, stops, strict=True):
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                logger.warning("%s did not stop within %.0fs; ending it", rank, STOP_SECONDS)
            except EngineDeadError:
                pass  # the executor died (a rank ended or hung, as logged then): the back end ends the rest
            except Exception:  # shutdown must complete even if a worker is broken
                logger.exception("%s failed to shut down cleanly", rank)
        self._end(deadline)
        self._fail_pending()  # calls of a rank whose end was not seen in time

    # ---- what a back end implements ----------------------------------------------------------------------
    @abstractmethod
    def _start_ranks(self) -> str | None:
        """Starts one rank per ``world_size`` into ``_ranks``, by rank; returns where the ranks of a
        tensor-parallel model meet (``None`` for one rank)."""

    def _local_rank(self, rank: R) -> int:
        """The device index the rank's worker takes on its host."""
        return rank.rank

    @abstractmethod
    def _post(self, lane: str, call_id: int, data: bytes, ranks: list[R]) -> Callable[[], None] | None:
        """Hands one call's bytes to ``lane`` of each of ``ranks``, behind the calls posted before it (under the
        driver's lock, which keeps that order); returns what is left to do once the lock is released."""

    @abstractmethod
    def _kill(self, rank: R) -> None:
        """Ends a hung rank now."""

    @abstractmethod
    def _ranks_to_stop(self, polite: bool) -> list[R]:
        """The ranks ``shutdown`` asks to stop (``polite``: the executor did not die first)."""

    @abstractmethod
    def _end(self, deadline: float) -> None:
        """Ends what is left of the ranks once asked to stop (by ``deadline``, then by force) and releases
        what holds them."""


def _dumps_callable(method: Callable[..., Any], name: str) -> bytes:
    try:
        data: bytes = cloudpickle.dumps(method, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"collective_rpc {name!r}: the callable cannot be sent to a worker process ({exc})") from exc
    return data
