"""EnginePool: several engines, one per model name, sharing one device under a memory budget.

Each engine's footprint is what sleeping frees (measured when the pool starts: every engine is
started, then put to sleep). ``generate(model_name, ...)`` wakes the target, first putting the
least recently used awake engines to sleep (mode "wait": their requests finish first) until the
budget and ``max_awake`` allow. Requests for a sleeping model wait during the switch; none is
dropped. An engine idle for ``idle_timeout`` seconds goes to sleep by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aioengine.config import EngineConfig
from aioengine.engine.async_engine import AsyncEngine, Prompt
from aioengine.engine.control import SleepMode, SleepReport, WakeReport
from aioengine.engine.outputs import RequestOutput
from aioengine.errors import ConfigurationError, UnknownModelError
from aioengine.messages import SleepLevel, check_choice
from aioengine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Tenant:
    """The pool's bookkeeping of one engine; whether it is awake, the engine itself says."""

    engine: AsyncEngine
    footprint: int = 0
    active: int = 0
    """Callers inside ``use()``: the engine is not put to sleep under them."""
    last_used: float = 0.0
    checkpoint_version: int = 0
    """The ``weights_version`` at which the engine holds its checkpoint's weights (what a reload gives back);
    past it, weights were pushed, and a level-2 sleep would lose them."""
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while ``active == 0``."""

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def awake(self) -> bool:
        return self.engine.is_awake

    def enter(self) -> None:
        self.active += 1
        self.idle.clear()
        self.last_used = time.monotonic()

    def leave(self) -> None:
        self.active -= 1
        self.last_used = time.monotonic()
        if self.active == 0:
            self.idle.set()


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of the pool."""

    awake: tuple[str, ...]
    switches: int
    budget_bytes: int | None
    footprints: dict[str, int]
    active: dict[str, int]
    leaving: tuple[str, ...] = ()
    """Engines a switch is putting to sleep (it waits for their callers first); their new callers wait for it."""


class EnginePool:
    """Multi-tenant engines on one device; at most ``max_awake`` awake and within ``budget_bytes``."""

    def __init__(
        self,
        engines: Mapping[str, EngineConfig | AsyncEngine],
        *,
        budget_bytes: int | None = None,
        max_awake: int | None = None,
        idle_timeout: float | None = None,
        sleep_level: SleepLevel = 1,
        awake_at_start: Sequence[str] = (),
    ) -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        if max_awake is not None and max_awake < 1:
            raise ValueError(f"max_awake must be >= 1, got {max_awake}")
        check_choice("sleep_level", sleep_level, SleepLevel)
        self.tenants = {
            name: _Tenant(e if isinstance(e, AsyncEngine) else AsyncEngine(e)) for name, e in engines.items()
        }
        self.budget_bytes = budget_bytes
        self.max_awake = max_awake
        self.idle_timeout = idle_timeout
        self.sleep_level = sleep_level
        unknown = [name for name in awake_at_start if name not in self.tenants]
        if unknown:
            raise ValueError(f"awake_at_start names engines the pool does not have: {unknown}")
        self.awake_at_start = tuple(awake_at_start)
        """Woken (in order, as far as budget and max_awake allow) once every footprint is measured."""
        self.num_switches = 0
        self._switch_lock = asyncio.Lock()
        self._leaving: set[str] = set()
        """Engines being put to sleep by a switch: their new requests wait for the switch instead."""
        self._idle_task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> EnginePool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Starts every engine and puts it to sleep, measuring what its sleep frees (its footprint), then
        wakes those named in ``awake_at_start`` so their first requests do not wait for a wake-up.

        If one cannot start (or does not fit the budget), every engine started so far is shut down.
        """
        try:
            for name, tenant in self.tenants.items():
                await tenant.engine.start()
                tenant.checkpoint_version = tenant.engine.weights_version
                report = await tenant.engine.sleep(self.sleep_level, mode="wait")
                tenant.footprint = report.freed_bytes.total
                if self.budget_bytes is not None and tenant.footprint > self.budget_bytes:
                    raise ConfigurationError(
                        f"engine {name!r} needs {tenant.footprint} bytes awake, more than the pool budget "
                        f"{self.budget_bytes}; raise budget_bytes or shrink that engine's KV cache"
                    )
            for name in self.awake_at_start:
                await self.wake_up(name)
        except BaseException:
            await self.shutdown()
            raise
        if self.idle_timeout is not None:
            self._idle_task = asyncio.get_running_loop().create_task(self._sleep_idle_engines())

    def _tenant(self, model_name: str) -> _Tenant:
        try:
            return self.tenants[model_name]
        except KeyError:
            raise UnknownModelError(
                f"no engine named {model_name!r} in the pool; known: {', '.join(self.tenants)}"
            ) from None

    def engine(self, model_name: str) -> AsyncEngine:
        """The engine serving ``model_name``, awake or not (``UnknownModelError`` if there is none)."""
        return self._tenant(model_name).engine

    @contextlib.asynccontextmanager
    async def use(self, model_name: str) -> AsyncIterator[AsyncEngine]:
        """Wakes ``model_name``'s engine if needed (putting others to sleep as the budget demands) and keeps
        it awake while the block runs: every request on a pooled engine runs inside one of these."""
        tenant = self._tenant(model_name)
        await self._acquire(model_name, tenant)
        try:
            yield tenant.engine
        finally:
            tenant.leave()

    async def generate(
        self,
        model_name: str,
        prompt: Prompt,
        params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request on ``model_name``'s engine, waking it first if needed."""
        async with self.use(model_name) as engine:
            async for out in engine.generate(prompt, params, request_id):
                yield out

    async def sleep(self, model_name: str, level: SleepLevel | None = None, mode: SleepMode = "wait") -> SleepReport:
        """Puts one engine to sleep on request (an admin's call), ordered with the pool's switches; a later
        request for it wakes it again. ``level`` defaults to the pool's ``sleep_level``."""
        tenant = self._tenant(model_name)
        async with self._switch_lock:
            return await tenant.engine.sleep(self.sleep_level if level is None else level, mode=mode)

    async def wake_up(self, model_name: str, tags: Iterable[str] | None = None) -> WakeReport | None:
        """Wakes one engine on request, first putting others to sleep as the budget demands. None if it was
        awake already. Weights a level-2 sleep discarded stay discarded, as after ``AsyncEngine.wake_up``: push
        new ones (``update_weights``) or ``reload_weights``; requests wait until then."""
        tenant = self._tenant(model_name)
        async with self._switch_lock:
            return None if tenant.awake else await self._wake(model_name, tenant, tags, reload=False)

    async def _wake(
        self, name: str, tenant: _Tenant, tags: Iterable[str] | None = None, reload: bool = True
    ) -> WakeReport:
        """With the switch lock held. ``reload``: a request is waiting, so weights a level-2 sleep discarded are
        loaded again from the checkpoint the engine started from."""
        await self._make_room_for(name, tenant)
        report = await tenant.engine.wake_up(tags)
        if reload and tenant.awake and not tenant.engine.stats().weights_valid:
            await tenant.engine.reload_weights()
            tenant.checkpoint_version = tenant.engine.weights_version
        self.num_switches += 1
        logger.info("pool: %s awake (%d bytes)", name, tenant.footprint)
        return report

    async def _acquire(self, name: str, tenant: _Tenant) -> None:
        if tenant.awake and name not in self._leaving:
            # Awake and staying so: no need to queue behind a switch of other models (which may be
            # waiting for a busy victim to drain).
            tenant.enter()
            return
        async with self._switch_lock:
            if not tenant.awake:
                await self._wake(name, tenant)
            tenant.enter()

    async def _make_room_for(self, name: str, tenant: _Tenant) -> None:
        while True:
            awake = [(n, t) for n, t in self.tenants.items() if t.awake and n != name]
            over_count = self.max_awake is not None and len(awake) + 1 > self.max_awake
            used = sum(t.footprint for _, t in awake)
            over_budget = self.budget_bytes is not None and used + tenant.footprint > self.budget_bytes
            if not awake or not (over_count or over_budget):
                return
            # An idle engine first (nothing to drain), then the least recently used.
            victim_name, victim = min(awake, key=lambda item: (item[1].active > 0, item[1].last_used))
            self._leaving.add(victim_name)  # from now on its new callers wait for this switch
            try:
                await victim.idle.wait()  # the callers inside use() finish first, their requests with them
                await victim.engine.sleep(self._switch_level(victim), mode="wait")
            finally:
                self._leaving.discard(victim_name)
            logger.info("pool: %s asleep to make room for %s", victim_name, name)

    def _switch_level(self, tenant: _Tenant) -> SleepLevel:
        """The pool's ``sleep_level``, except level 1 for an engine whose weights were pushed since its
        checkpoint was loaded: level 2 would discard them, and the wake would reload the checkpoint."""
        if self.sleep_level == 2 and tenant.engine.weights_version != tenant.checkpoint_version:
            return 1
        return self.sleep_level

    async def _sleep_idle_engines(self) -> None:
        assert self.idle_timeout is not None
        while True:
            await asyncio.sleep(max(self.idle_timeout / 4, 0.01))
            now = time.monotonic()
            async with self._switch_lock:
                for name, tenant in self.tenants.items():
                    if tenant.awake and tenant.active == 0 and now - tenant.last_used >= self.idle_timeout:
                        try:
                            await tenant.engine.sleep(self._switch_level(tenant), mode="wait")
                        except Exception:  # one engine's failure must not end idle sleeping for all
                            logger.exception("pool: putting idle %s to sleep failed; it stays awake", name)
                            tenant.last_used = now  # try again after another idle_timeout
                            continue
                        logger.info("pool: %s asleep after %.1fs idle", name, now - tenant.last_used)

    def awake_models(self) -> list[str]:
        return [name for name, tenant in self.tenants.items() if tenant.awake]

    def stats(self) -> PoolStats:
        return PoolStats(
            awake=tuple(self.awake_models()),
            switches=self.num_switches,
            budget_bytes=self.budget_bytes,
            footprints={name: t.footprint for name, t in self.tenants.items()},
            active={name: t.active for name, t in self.tenants.items()},
            leaving=tuple(self._leaving),
        )

    async def shutdown(self) -> None:
        """Stops the idle watcher and every engine (asleep or not). Safe to call more than once."""
        if self._idle_task is not None:
            self._idle_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._idle_task
            self._idle_task = None
        for tenant in self.tenants.values():
            await tenant.engine.shutdown()
