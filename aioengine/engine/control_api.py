"""The control calls of ``AsyncEngine``: what an operator or a trainer calls beside requests.

Worker RPCs, health and profiling; sleep / wake, weight updates, pause / resume and the prefix
cache. ``AsyncEngine`` takes them in as a base class; each one passes its guards
(``_require_core``) and hands the work to ``EngineCore``, the executor, or ``EngineControl``
(``control.py``), which runs every sleep, wake, weight write and pause as one control session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from aioengine.engine.control import (
    PauseMode,
    PauseReport,
    SleepMode,
    SleepReport,
    UpdateMode,
    WakeReport,
    WeightUpdateReport,
)
from aioengine.errors import EngineStateError, WeightsLostError
from aioengine.messages import SleepLevel, WorkerWeightsReport

if TYPE_CHECKING:
    from aioengine.engine.control import EngineControl
    from aioengine.engine.core import EngineCore
    from aioengine.executor.base import Executor
    from aioengine.messages import ModelInfo

__all__ = ["ControlAPI"]


class ControlAPI:
    """The control calls of ``AsyncEngine``, which owns the state and the guards they use."""

    if TYPE_CHECKING:
        executor: Executor | None
        core: EngineCore | None
        model_info: ModelInfo | None

        def _require_core(self) -> EngineCore: ...

        def _require_control(self) -> EngineControl: ...

    # ---- workers -----------------------------------------------------------------------------------
    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Runs a worker method (or a callable taking the worker) on every rank, ordered with the steps: it
        runs once the step running now is done. A step queued behind that one that no worker has started is
        taken back first, where the executor can (``EngineCore.revoke_queued_step``), and runs after it.

        A method that writes weights through the worker's one write path (``Worker.write_weights``, as
        the weight-sync plugin does) returns a ``WorkerWeightsReport``; the engine takes the new
        ``weights_version`` from it, and serves again once a full write replaced discarded weights.
        """
        core = self._require_core()
        assert self.executor is not None
        core.revoke_queued_step()
        try:
            results = await self.executor.collective_rpc(method, args, kwargs, timeout, unique_reply_rank)
        except WeightsLostError:
            core.weights_lost()
            raise
        replies = results if unique_reply_rank is None else [results]
        reports = [r for r in replies if isinstance(r, WorkerWeightsReport)]
        if reports:
            core.weights_written(WorkerWeightsReport.merge(reports))
        return results

    async def check_health(self, timeout: float = 30.0) -> None:
        """Raises EngineDeadError if the engine died, EngineStateError while a timed-out RPC still holds a
        worker (model steps wait behind it), or the worker's error if a worker is unhealthy."""
        self._require_core()
        assert self.executor is not None
        overdue = self.executor.overdue_calls()
        if overdue:
            raise EngineStateError(f"a worker is held by {', '.join(overdue)}; model steps wait until it returns")
        await self.collective_rpc("check_health", timeout=timeout)

    async def start_profile(self) -> None:
        """Starts the torch profiler on every worker (needs ``profiler.dir``)."""
        await self.collective_rpc("profile", (True,))

    async def stop_profile(self) -> list[str | None]:
        """Stops the profiler; traces are written under ``profiler.dir``. Returns that dir per rank."""
        result: list[str | None] = await self.collective_rpc("profile", (False,))
        return result

    # ---- sleep, wake, weights ------------------------------------------------------------------------
    async def sleep(self, level: SleepLevel = 1, mode: SleepMode = "wait") -> SleepReport:
        """Frees the engine's device memory so another tenant can use it.

        level 1 keeps a host copy of the weights; level 2 discards them (load them again with
        ``reload_weights`` or ``update_weights`` after ``wake_up``). ``mode`` says what happens to
        requests in flight: "wait" finishes them first, "abort" ends them (finish_reason "abort"),
        "keep" preempts them and they continue after wake, recomputing their KV. Requests submitted
        while asleep wait and run after wake. A caller that is cancelled or times out while the
        workers free their memory does not stop them: the sleep completes and is recorded.
        """
        return await self._require_control().sleep(level, mode)

    async def wake_up(self, tags: Iterable[str] | None = None) -> WakeReport:
        """Restores "weights" and/or "kv_cache" (default both). Scheduling resumes only once every
        tag is awake (and, after level 2, the weights were loaded again)."""
        return await self._require_control().wake_up(tags)

    async def is_sleeping(self) -> bool:
        """True until every tag is awake."""
        return self._require_core().memory.is_sleeping

    async def reload_weights(self, mode: UpdateMode = "pause") -> WeightUpdateReport:
        """Loads the checkpoint the engine started from into the model again, in place (e.g. after
        sleep level 2)."""
        self._require_core()
        assert self.model_info is not None
        return await self.update_weights(self.model_info.model_path, mode=mode)

    async def update_weights(
        self,
        source: Any,
        mode: UpdateMode = "pause",
        partial: bool = False,
        stage: bool = False,
        allow_non_finite: bool = False,
    ) -> WeightUpdateReport:
        """Swaps new weights into the live engine, all or nothing.

        ``source``: a safetensors file or directory, a ``{name: tensor}`` dict, or an iterable of
        ``(name, tensor)`` (checkpoint names; q/k/v and gate/up are fused for you). Every tensor's
        name, shape and dtype is checked before the first write; a bad source raises
        ``CheckpointError`` naming the tensor, changes nothing, and the engine keeps serving.
        ``partial=True`` allows updating only some tensors. ``mode`` for requests in flight:
        "pause" swaps between two steps (they go on with the new weights), "drain" finishes them on
        the old weights first, "abort" ends them, "recompute" drops their KV and recomputes it under
        the new weights. Requests sent meanwhile wait; none is dropped. ``stage=True`` reads and
        checks the whole source into host memory while the engine keeps serving, so the pause covers
        only the copy.

        Tensors held in memory must be readable as they are (not on the meta device, not DTensor
        shards, dense) and finite (``allow_non_finite=True`` writes NaN / Inf anyway). Files are
        streamed, so their data is checked as it is written: a non-finite tensor, or a file that breaks
        after the first write, raises ``WeightsLostError`` and the engine serves nothing until a full
        update or ``reload_weights`` succeeds (never a mix of old and new). ``stage=True`` checks
        everything before the first write.
        """
        return await self._require_control().update_weights(source, mode, partial, stage, allow_non_finite)

    async def pause_generation(self, mode: PauseMode = "abort") -> PauseReport:
        """Stops generation between two steps until ``resume_generation()`` (vLLM's AsyncLLM call of the
        same name), e.g. while a trainer pushes new weights.

        ``mode`` says what happens to requests in flight: "abort" ends them and the queued ones
        (finish_reason "abort"), "wait" finishes them first (requests sent meanwhile wait), "keep"
        freezes them between two steps with their KV cache, and they continue unchanged on resume.
        Requests sent while paused are accepted and wait. sleep, wake_up and update_weights work while
        paused, except the modes that finish requests first (sleep "wait", update_weights "drain",
        pause "wait"): with requests queued they could never end, so they raise EngineStateError.
        Pausing again is allowed ("abort" ends what is queued, the others change nothing). A caller
        cancelled before the pause took hold (e.g. during a "wait" drain) leaves the engine running.
        """
        return await self._require_control().pause_generation(mode)

    async def resume_generation(self) -> None:
        """Lets a paused engine step again: frozen and queued requests go on. A no-op when not paused."""
        await self._require_control().resume_generation()

    async def is_paused(self) -> bool:
        """True from a pause_generation() until resume_generation()."""
        return self._require_core().paused

    async def reset_prefix_cache(self, force: bool = False) -> int:
        """Forgets every cached prefix; returns how many blocks were cached. Refused (EngineStateError) while
        requests are in flight unless ``force``: they keep their blocks either way, but those blocks will not
        be cached again. Weight writes and sleep empty the cache by themselves."""
        core = self._require_core()
        busy = len(core.states)
        if busy and not force:
            raise EngineStateError(
                f"cannot reset the prefix cache: {busy} requests are in flight; wait for them, or pass force=True "
                "(they keep their blocks, which are then not cached again)"
            )
        return core.drop_prefix_cache()

    @property
    def weights_version(self) -> int:
        """+1 per successful weight write; outputs carry the version they were computed with."""
        return self.core.weights_version if self.core is not None else 0

    @property
    def is_awake(self) -> bool:
        """Started, alive, and every tag awake (the weights may still need a reload after level 2)."""
        core = self.core
        return core is not None and core.dead is None and not core.memory.is_sleeping
