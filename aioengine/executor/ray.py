"""RayExecutor: each worker rank lives in a Ray actor, driven from the engine process.

For ranks on one node or several (``parallel.distributed_executor_backend = "ray"``). The ranks' actors sit in one
placement group, one bundle per rank (a GPU each on CUDA, a CPU otherwise), all on one node when one has room
(STRICT_PACK), else on as few as Ray can (PACK). Each actor holds a lazy ``WorkerWrapper``: the worker is built
by ``init_worker`` only once Ray placed the actor and set the devices it sees (its one GPU is ``cuda:0``
there, so every local rank is 0). The tensor-parallel group meets on 127.0.0.1 when every rank is on one
node, else at rank 0's node address, on a port free on rank 0's node.

The driver is the one of ``MultiprocExecutor``, and so are the messages: every call reaches every rank in the
order it was submitted (Ray runs one caller's calls to an actor in order), as the bytes ``(call_id, method,
args, kwargs)`` a worker process reads, answered by ``(call_id, ok, value)``: callables travel cloudpickled,
worker exceptions keep their types. An actor has three lanes, each a Ray concurrency group of one thread:
the default one serves steps and RPCs one at a time, ``aside`` serves ``run_aside``, and ``sentinel`` holds a
call that never returns, so that an actor that dies is seen at once, between calls too. A dead actor
(``RayActorError``) fails every pending and later call with ``EngineDeadError`` naming the rank; a step that
outlives ``parallel.step_timeout_s`` on some rank kills the executor (a hung rank). Actors never outlive the
engine process: Ray ends an actor with the process that created it.

Ray is an optional extra (``pip install "aioengine[ray]"``), imported when the executor starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from aioengine.errors import AIOEngineError, ConfigurationError, EngineDeadError
from aioengine.executor.base import Executor, execute_and_sample
from aioengine.executor.multiproc import _STEP, STOP_SECONDS, _dumps_callable, _retrieve
from aioengine.executor.thread import _bridge
from aioengine.loopback import LOOPBACK, free_port
from aioengine.messages import ModelRunnerOutput, SchedulerOutput
from aioengine.worker.process import _run, dumps
from aioengine.worker.wrapper import WorkerWrapper

logger = logging.getLogger(__name__)

PLACEMENT_SECONDS = 120.0
"""How long the start waits for Ray to reserve the ranks' bundles before it gives up, naming what is missing."""
_INLINE_BYTES = 100 * 1024
"""A call larger than this is put in Ray's object store once for every rank to read (Ray's own threshold
for sending an argument inline)."""
_LANES = {"aside": 1, "sentinel": 1}
"""The actor's concurrency groups beside the default one (steps and RPCs, one thread: in order)."""


def _import_ray() -> ModuleType:
    try:
        import ray
        import ray.util.scheduling_strategies
    except ImportError as exc:
        raise ConfigurationError(
            "parallel.distributed_executor_backend='ray' needs Ray, which is not installed: "
            'pip install "aioengine[ray]"'
        ) from exc
    return ray


# ---- the actor (in the rank's Ray worker process) ----------------------------------------------------------
class RankActor:
    """One rank inside its Ray actor: the worker process's loop of ``MultiprocExecutor``, with Ray as the pipe."""

    def __init__(self, rank: int) -> None:
        self.wrapper = WorkerWrapper(rank)

    def call(self, data: bytes) -> bytes:
        """One call in the worker process's wire format, and its reply (an exception is a reply too)."""
        reply, _ = _run(data, self.wrapper)
        return reply

    def where(self) -> tuple[str, int, int]:
        """This actor's node address and pid, and a TCP port free on its node now (for the group's store)."""
        return _import_ray().util.get_node_ip_address(), os.getpid(), free_port()

    def wait_for_death(self) -> None:
        """Never returns: the call fails when the actor dies, which tells the executor at once."""
        threading.Event().wait()


# ---- Ray for the engine process ------------------------------------------------------------------------
_started_lock = threading.Lock()
_started_users: int | None = None
"""How many executors use the Ray instance started here (None: this module started none). The last one out
shuts it down: the engines of a pool share it, and Ray the application started is the application's."""


def _join_ray(ray: ModuleType, address: str | None, min_cpus: int) -> bool:
    """Connects to Ray, or starts a local instance; True when this executor must leave it (``_leave_ray``)."""
    global _started_users
    with _started_lock:
        if not ray.is_initialized():
            try:
                if address is None:  # a private instance on this host, with a CPU per rank at least
                    ray.init(address="local", num_cpus=max(min_cpus, os.cpu_count() or 1), include_dashboard=False)
                else:
                    ray.init(address=address)
            except ConnectionError as exc:
                raise ConfigurationError(
                    f"parallel.ray_address={address!r}: no Ray cluster answers there ({exc}); start one "
                    "(`ray start --head`) or unset parallel.ray_address for a local instance"
                ) from exc
            _started_users = 0
        if _started_users is None:
            return False
        _started_users += 1
        return True


def _leave_ray(ray: ModuleType) -> None:
    global _started_users
    with _started_lock:
        if _started_users is None:
            return
        _started_users -= 1
        if _started_users == 0:
            _started_users = None
            ray.shutdown()


# ---- the engine process --------------------------------------------------------------------------------
@dataclass(eq=False)
class _Rank:
    rank: int
    actor: Any
    """The Ray actor handle."""
    node_ip: str = "?"
    pid: int | None = None
    pending: dict[int, concurrent.futures.Future[Any]] = field(default_factory=dict)
    """Calls sent on any lane and not answered yet, oldest first."""

    def __str__(self) -> str:
        return f"worker rank {self.rank} (Ray actor, pid {self.pid} on {self.node_ip})"


def _devices(resources: dict[str, float]) -> dict[str, float]:
    return {name: resources.get(name, 0.0) for name in ("CPU", "GPU")}


def _how_it_ended(error: BaseException | None) -> str:
    """Ray's own reason, from its ActorDiedError ("The actor is dead because ...")."""
    lines = [line.strip() for line in str(error or "").splitlines() if line.strip()]
    return next((line for line in lines if "dead because" in line), lines[0] if lines else "it ended")


class RayExecutor(Executor):
    """One Ray actor per rank, in one placement group, driven from the engine process."""

    def __init__(self, config: Any) -> None:
        self._ray = _import_ray()
        self.config = config
        self.world_size = config.parallel.tensor_parallel_size
        self.step_timeout = float(config.parallel.step_timeout_s)
        """A step that has not come back from every rank after this long means a hung rank: the executor dies."""
        self._lock = threading.Lock()
        """Guards the ranks' pending calls and the two flags below (Ray's threads settle calls)."""
        self._closed = False
        self._dead: str | None = None
        """Why the executor cannot serve any more: an actor died, or a step hung."""
        self._call_ids = itertools.count()
        self._overdue: dict[asyncio.Future[Any], tuple[str, float]] = {}
        """Calls whose caller timed out while they still run, with their name and when."""
        self._ranks: list[_Rank] = []
        self._steps: dict[int, float] = {}
        """Steps sent and not answered by every rank yet: call id -> when sent (the watchdog's view)."""
        self._wake_watchdog = threading.Event()
        self._in_ray = False
        self.placement_group: Any = None
        self._sentinels: list[Any] = []
        try:
            self._in_ray = _join_ray(self._ray, config.parallel.ray_address, self.world_size)
            self._place()
            meeting = self._start_actors()
            inits = [
                self._send("step", "init_worker", (config, 0, meeting), {}, "init_worker", [r]) for r in self._ranks
            ]
            for [future] in inits:
                future.result()
        except BaseException:
            self.shutdown()
            raise
        self._watchdog = threading.Thread(target=self._watch_steps, name="aioengine-ray-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles, by rank."""
        return [r.actor for r in self._ranks]

    @property
    def pids(self) -> list[int | None]:
        return [r.pid for r in self._ranks]

    def _place(self) -> None:
        """Reserves one bundle per rank, all on one node when one has room for them."""
        ray = self._ray
        device = self.config.device.device
        on_gpus = bool(ray.cluster_resources().get("GPU")) if device == "auto" else device.startswith("cuda")
        self._resource = resource = "GPU" if on_gpus else "CPU"
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        strategy = "STRICT_PACK" if any(n.get(resource, 0) >= self.world_size for n in nodes) else "PACK"
        self.placement_group = ray.util.placement_group([{resource: 1}] * self.world_size, strategy=strategy)
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise ConfigurationError(
                f"Ray could not reserve {self.world_size} x {{'{resource}': 1}} ({strategy}) for "
                f"parallel.tensor_parallel_size={self.world_size} within {PLACEMENT_SECONDS:.0f}s (the cluster has "
                f"{_devices(ray.cluster_resources())}, free: {_devices(ray.available_resources())}); lower "
                "tensor_parallel_size, free or add resources, or set device.device"
            ) from None

    def _start_actors(self) -> str | None:
        """One actor per rank, each in its bundle; returns where the ranks' group meets (None for one rank)."""
        ray = self._ray
        actor_class = ray.remote(concurrency_groups=_LANES)(RankActor)
        gpus = 1 if self._resource == "GPU" else 0
        for rank in range(self.world_size):
            placed = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank
            )
            options = {"num_cpus": 1 - gpus, "num_gpus": gpus, "max_restarts": 0, "max_task_retries": 0}
            self._ranks.append(_Rank(rank, actor_class.options(scheduling_strategy=placed, **options).remote(rank)))
        try:
            places = ray.get([r.actor.where.remote() for r in self._ranks])
        except ray.exceptions.RayActorError as exc:
            raise AIOEngineError(
                f"the Ray actor of a worker rank could not start (is aioengine installed on every node?): {exc}"
            ) from exc
        for worker, (node_ip, pid, _) in zip(self._ranks, places, strict=True):
            worker.node_ip, worker.pid = node_ip, pid
            sentinel = worker.actor.wait_for_death.options(concurrency_group="sentinel").remote()
            self._sentinels.append(sentinel)  # its future holds the callback; the reference keeps the call
            sentinel.future().add_done_callback(functools.partial(self._sentinel_ended, worker))
        if self.world_size == 1:
            return None
        host = LOOPBACK if len({r.node_ip for r in self._ranks}) == 1 else self._ranks[0].node_ip
        return f"tcp://{host}:{places[0][2]}"

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
        """Sends one call to every rank (or to ``ranks``), pickled once, behind the calls already sent.
        Refused once the executor is dead or shut down, unless ``force`` (the stop message). A ``watched``
        call (a step) that is not answered by every rank within ``step_timeout`` kills the executor."""
        call_id = next(self._call_ids)
        try:
            data = dumps((call_id, method, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"{name!r}: its arguments cannot be sent to a worker process ({exc}); pass data that pickles "
                "(a path, a dict of tensors, a list rather than an iterator)"
            ) from exc
        futures: list[concurrent.futures.Future[Any]] = []
        replies: list[tuple[_Rank, concurrent.futures.Future[bytes]]] = []
        with self._lock:  # calls leave in the order they were submitted: that is the order Ray runs them in
            if not force:
                if self._dead is not None:
                    raise EngineDeadError(self._dead)
                if self._closed:
                    raise EngineDeadError("the executor is shut down; create a new engine")
            targets = self._ranks if ranks is None else ranks
            payload = self._ray.put(data) if len(data) > _INLINE_BYTES and len(targets) > 1 else data
            for rank in targets:
                call = rank.actor.call if lane == "step" else rank.actor.call.options(concurrency_group=lane)
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                rank.pending[call_id] = future
                replies.append((rank, call.remote(payload).future()))
                futures.append(future)
            if watched:
                self._steps[call_id] = time.monotonic()
                self._wake_watchdog.set()
        for rank, reply in replies:  # outside the lock: a reply that is there already settles at once
            reply.add_done_callback(functools.partial(self._settle, rank, call_id))
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
                f"collective_rpc {name!r} timed out after {timeout}s; it still runs in the Ray actor and model "
                "steps wait behind it until it returns"
            )
        results = [future.result() for future in futures]
        return results[unique_reply_rank] if unique_reply_rank is not None else results

    def overdue_calls(self) -> list[str]:
        now = time.monotonic()
        return [f"{name!r} (timed out, running {now - since:.1f}s)" for name, since in self._overdue.values()]

    def submit_step(self, scheduler_output: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        # Sent right here, behind every call submitted before it; rank 0's output is the step's.
        _, futures = self._call("step", execute_and_sample, (scheduler_output,), {}, watched=True)
        return futures[0] if len(futures) == 1 else _once_every_rank_answered(futures)

    async def run_aside(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        _, futures = self._call("aside", method, args, {})
        return list(await asyncio.gather(*futures))

    # ---- watching for a hung rank ------------------------------------------------------------------------
    def _step_answered(self, call_id: int, _: object = None) -> None:
        with self._lock:
            if call_id in self._steps and not any(call_id in r.pending for r in self._ranks):
                del self._steps[call_id]

    def _watch_steps(self) -> None:
        """Fails the executor when a step outlives ``step_timeout`` on some rank (a rank that hangs never
        answers; a rank that dies is seen by its sentinel)."""
        while True:
            with self._lock:
                if self._closed or self._dead is not None:
                    return
                oldest = min(self._steps.items(), key=lambda item: item[1], default=None)
                late = None
                if oldest is not None and time.monotonic() - oldest[1] > self.step_timeout:
                    late = [r for r in self._ranks if oldest[0] in r.pending]
                    self._dead = (
                        f"worker rank(s) {[r.rank for r in late]} did not finish a model step within "
                        f"parallel.step_timeout_s={self.step_timeout:g}s (hung); the engine cannot serve without "
                        "them: create a new engine"
                    )
            if late is not None:
                logger.error("%s", self._dead)
                self._fail_pending()
                for rank in late:  # a hung actor holds its device and cores: it is gone now
                    with contextlib.suppress(Exception):
                        self._ray.kill(rank.actor)
                return
            # Until the oldest step's deadline, or until a step is sent (or the executor closes).
            self._wake_watchdog.wait(None if oldest is None else oldest[1] + self.step_timeout - time.monotonic())
            self._wake_watchdog.clear()

    # ---- receiving (on Ray's threads) ------------------------------------------------------------------
    def _settle(self, rank: _Rank, call_id: int, reply: concurrent.futures.Future[bytes]) -> None:
        error = reply.exception()
        if isinstance(error, self._ray.exceptions.RayActorError):
            self._lost(rank, error)
            return
        with self._lock:
            future = rank.pending.pop(call_id, None)
        if future is None:
            return  # failed already (the executor died or shut down meanwhile)
        if error is not None:  # Ray could not deliver the reply (e.g. its object was lost)
            future.set_exception(error)
            return
        try:
            _, ok, value = pickle.loads(reply.result())
        except Exception as exc:
            ok, value = False, RuntimeError(f"a reply of {rank} cannot be read in the engine process: {exc}")
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _sentinel_ended(self, rank: _Rank, sentinel: concurrent.futures.Future[None]) -> None:
        self._lost(rank, sentinel.exception())

    def _lost(self, rank: _Rank, error: BaseException | None) -> None:
        """An actor died: unless the executor stopped it, the executor is dead. Either way every call still
        pending on any rank fails (the ranks of one model cannot go on without one of them)."""
        with self._lock:
            if not self._closed and self._dead is None:
                self._dead = (
                    f"{rank} died: {_how_it_ended(error)}; the engine cannot serve without it: create a new engine"
                )
                logger.error("%s", self._dead)
        self._fail_pending()

    def _fail_pending(self) -> None:
        with self._lock:
            reason = self._dead or "the executor is shut down; create a new engine"
            orphans = [f for rank in self._ranks for f in rank.pending.values()]
            for rank in self._ranks:
                rank.pending.clear()
        for future in orphans:
            future.set_exception(EngineDeadError(reason))

    # ---- stopping --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            polite = self._dead is None  # after a death a survivor may sit in a collective with the dead rank
        self._wake_watchdog.set()
        deadline = time.monotonic() + STOP_SECONDS
        stops = self._send("step", None, (), {}, "shutdown", force=True) if polite and self._ranks else []
        for future in stops:  # behind the calls already sent: a call that never returns holds it
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                logger.warning("a worker did not stop within %.0fs; killing its actor", STOP_SECONDS)
            except EngineDeadError:
                pass  # its actor is gone already
            except Exception:  # shutdown must complete even if a worker is broken
                logger.exception("a worker failed to shut down cleanly")
        ray = self._ray
        for rank in self._ranks:
            with contextlib.suppress(Exception):  # gone already, or Ray with it
                ray.kill(rank.actor)
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.placement_group)
        if self._in_ray:
            _leave_ray(ray)
        self._fail_pending()


def _once_every_rank_answered(futures: list[asyncio.Future[Any]]) -> asyncio.Future[Any]:
    """Rank 0's output once every rank answered. A failed step fails with the error that explains it: a dead
    or hung rank's ``EngineDeadError`` (at once) before its peers' broken collectives, else the first error."""
    step: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    errors: list[BaseException] = []

    def settle(done: asyncio.Future[Any]) -> None:
        if not done.cancelled() and (error := done.exception()) is not None:
            errors.append(error)
        if step.done():
            return
        if dead := [e for e in errors if isinstance(e, EngineDeadError)]:
            step.set_exception(dead[0])
        elif all(f.done() for f in futures):
            if errors:
                step.set_exception(errors[0])
            else:
                step.set_result(futures[0].result())

    for future in futures:
        future.add_done_callback(settle)
    return step
