"""ControlSession: one control call's hold on the engine, from ``EngineCore.control()``.

A session stops the step loop between two steps in a defined way (``quiesce``, by a ``QuiesceMode``)
and runs the control call's worker call shielded (``run``); ``EngineCore.control()`` hands it out one
at a time and lets the loop go on when it is left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from aioengine.errors import EngineStateError

if TYPE_CHECKING:
    from aioengine.engine.core import EngineCore

__all__ = ["ControlSession", "QuiesceMode"]

T = TypeVar("T")

QuiesceMode = Literal["pause", "drain", "abort", "preempt"]
"""What happens to accepted requests when a control call stops the loop: "pause" keeps them as they are
(they go on after), "drain" finishes them first (new ones wait), "abort" ends them (finish_reason
"abort"), "preempt" drops their KV (recomputed after, nothing lost)."""


class ControlSession:
    """One control call's hold on the engine, from ``EngineCore.control()``."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self.aborted = 0
        self.preempted = 0
        self._outstanding: asyncio.Task[Any] | None = None

    async def quiesce(self, mode: QuiesceMode) -> None:
        """Stops the loop between two steps; returns once no step is in flight. A step queued behind the
        running one is revoked where it can be (``EngineCore.revoke_queued_step``), so only one is waited for.

        "drain" on an engine that cannot serve (asleep, weights discarded) or whose generation is paused
        raises EngineStateError with queued requests, since they could never finish.
        """
        core = self._core
        if mode == "drain":
            if not core.memory.can_serve and core.scheduler.has_unfinished_requests():
                raise EngineStateError(
                    f"cannot drain: {core.memory.why_not_serving()}, so the "
                    f"{len(core.scheduler.requests)} queued requests could never finish; choose another mode"
                )
            if core.paused and core.scheduler.has_unfinished_requests():
                raise EngineStateError(
                    f"cannot drain: generation is paused (pause_generation), so the {len(core.scheduler.requests)} "
                    "requests it holds could never finish; call resume_generation() first, or choose another mode"
                )
            core._hold_admission = True  # new requests wait in `held` until the session ends
            await core._until_idle()
        core._quiesced = True
        core.revoke_queued_step()
        if mode == "abort":
            self.aborted = core.abort_all()
        await core._until_idle()
        if mode == "preempt":
            self.preempted = core.scheduler.preempt_all()

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Runs ``work`` (a worker call and the recording of its outcome) to its end even if the caller
        is cancelled or times out: the cancellation reaches the caller, while the engine stays held until
        the call is over, so its state always matches the workers'."""
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                self._outstanding = task
            raise
