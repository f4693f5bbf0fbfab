"""RayExecutor: each worker rank lives in a Ray actor, driven from the engine process.

For ranks on one node or several (``parallel.distributed_executor_backend = "ray"``). The driver, the wire
format and the step watchdog are ``RemoteExecutor``'s (``aioengine.executor.remote``); what lives here is Ray:
the actors, their placement group, their sentinels, and starting or leaving Ray itself. The ranks' actors sit in
one placement group, one bundle per rank (a GPU each on CUDA, a CPU otherwise), all on one node when one has
room (STRICT_PACK), else on as few as Ray can (PACK). Each actor holds a lazy ``WorkerWrapper``: the worker is
built by ``init_worker`` only once Ray placed the actor and set the devices it sees (its one GPU is ``cuda:0``
there, so every local rank is 0). The tensor-parallel group meets on 127.0.0.1 when every rank is on one node,
else at rank 0's node address, on a port free on rank 0's node.

Every call reaches every rank in the order it was submitted (Ray runs one caller's calls to an actor in
order), as the bytes a worker process reads (``aioengine.worker.process``); a call too large to go inline is
put in Ray's object store once for every rank. An actor has three lanes, each a Ray concurrency group of one
thread: the default one serves steps and RPCs one at a time (and decodes the steps, as a worker process's step
lane does), ``aside`` serves ``run_aside``, and ``sentinel`` holds a call that never returns, so that an actor
that dies is seen at once, between calls too. A dead actor (``RayActorError``) fails every pending and later
call with ``EngineDeadError`` naming the rank. Actors never outlive the engine process: Ray ends an actor with
the process that created it.

Ray is an optional extra (``pip install "aioengine[ray]"``), imported when the executor starts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

from aioengine.errors import AIOEngineError, ConfigurationError
from aioengine.executor.remote import Rank, RemoteExecutor
from aioengine.loopback import LOOPBACK, free_port
from aioengine.worker.process import run_call
from aioengine.worker.step_wire import StepDecoder
from aioengine.worker.wrapper import WorkerWrapper

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
    """One rank inside its Ray actor: the worker process's two lanes, with Ray as the pipe."""

    def __init__(self, rank: int) -> None:
        self.wrapper = WorkerWrapper(rank)
        self.steps = StepDecoder()
        """What the step lane holds from the step before (steps come on the default lane only)."""

    def call(self, data: bytes) -> bytes:
        """One call of the step lane in the worker process's wire format, and its reply (an exception is a
        reply too)."""
        reply, _ = run_call(data, self.wrapper, self.steps)
        return reply

    def call_aside(self, data: bytes) -> bytes:
        """One call of the aside lane, as ``call``."""
        reply, _ = run_call(data, self.wrapper)
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
class _Rank(Rank):
    """A rank's Ray actor, and where it runs."""

    actor: Any
    """The Ray actor handle."""
    node_ip: str = "?"
    pid: int | None = None

    def __str__(self) -> str:
        return f"worker rank {self.rank} (Ray actor, pid {self.pid} on {self.node_ip})"


def _devices(resources: dict[str, float]) -> dict[str, float]:
    return {name: resources.get(name, 0.0) for name in ("CPU", "GPU")}


def _how_it_ended(error: BaseException | None) -> str:
    """Ray's own reason, from its ActorDiedError ("The actor is dead because ...")."""
    lines = [line.strip() for line in str(error or "").splitlines() if line.strip()]
    return next((line for line in lines if "dead because" in line), lines[0] if lines else "it ended")


class RayExecutor(RemoteExecutor[_Rank]):
    """One Ray actor per rank, in one placement group, driven from the engine process."""

    calls_run_in: ClassVar[str] = "the Ray actor"
    thread_prefix: ClassVar[str] = "aioengine-ray"

    def __init__(self, config: Any) -> None:
        self._ray = _import_ray()
        self._in_ray = False
        self.placement_group: Any = None
        self._sentinels: list[Any] = []
        super().__init__(config)

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles, by rank."""
        return [r.actor for r in self._ranks]

    @property
    def pids(self) -> list[int | None]:
        return [r.pid for r in self._ranks]

    def _start_ranks(self) -> str | None:
        self._in_ray = _join_ray(self._ray, self.config.parallel.ray_address, self.world_size)
        self._place()
        return self._start_actors()

    def _local_rank(self, rank: _Rank) -> int:
        return 0  # Ray sets the devices an actor sees: its one GPU is cuda:0

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

    def _post(self, lane: str, call_id: int, data: bytes, ranks: list[_Rank]) -> Callable[[], None] | None:
        payload = self._ray.put(data) if len(data) > _INLINE_BYTES and len(ranks) > 1 else data
        replies = []
        for rank in ranks:
            call = rank.actor.call if lane == "step" else rank.actor.call_aside.options(concurrency_group=lane)
            replies.append((rank, call.remote(payload)))

        def watch() -> None:  # outside the lock: a reply that is there already settles at once
            for rank, reply in replies:
                reply.future().add_done_callback(functools.partial(self._replied, rank, lane, call_id))

        return watch

    def _kill(self, rank: _Rank) -> None:
        with contextlib.suppress(Exception):  # gone already, or Ray with it
            self._ray.kill(rank.actor)

    # ---- receiving (on Ray's threads) ------------------------------------------------------------------
    def _replied(self, rank: _Rank, lane: str, call_id: int, reply: concurrent.futures.Future[bytes]) -> None:
        error = reply.exception()
        if isinstance(error, self._ray.exceptions.RayActorError):
            self._lost(f"{rank} died: {_how_it_ended(error)}")
        elif error is not None:  # Ray could not deliver the reply (e.g. its object was lost)
            self._resolve(rank, lane, call_id, False, error)
        else:
            self._settle(rank, lane, reply.result(), call_id)

    def _sentinel_ended(self, rank: _Rank, sentinel: concurrent.futures.Future[None]) -> None:
        self._lost(f"{rank} died: {_how_it_ended(sentinel.exception())}")

    # ---- stopping --------------------------------------------------------------------------------------
    def _ranks_to_stop(self, polite: bool) -> list[_Rank]:
        # After a death a survivor may sit in a collective with the dead rank: it is killed, not asked.
        return self._ranks if polite else []

    def _end(self, deadline: float) -> None:
        for rank in self._ranks:
            self._kill(rank)
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                self._ray.util.remove_placement_group(self.placement_group)
        if self._in_ray:
            _leave_ray(self._ray)
