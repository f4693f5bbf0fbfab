"""Sleep / wake and hot weight swap: the engine-side control of the worker's memory and weights.

Each operation pauses the step loop between two steps (``EngineCore.pause``) and decides what
happens to requests in flight by its mode; one operation runs at a time (``_control_lock``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aioengine.errors import InvalidRequestError

if TYPE_CHECKING:
    from aioengine.config import EngineConfig
    from aioengine.engine.core import EngineCore
    from aioengine.executor.base import Executor

logger = logging.getLogger(__name__)


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from per-rank reports: byte counts add up, notes are kept once."""
    merged: dict[str, Any] = {}
    for report in reports:
        for key, value in report.items():
            if isinstance(value, dict):
                bucket = merged.setdefault(key, {})
                for k, v in value.items():
                    bucket[k] = bucket.get(k, 0) + v
            elif isinstance(value, list):
                merged.setdefault(key, [])
                merged[key] += [v for v in value if v not in merged[key]]
            elif isinstance(value, int | float) and not isinstance(value, bool):
                merged[key] = max(merged.get(key, 0), value)  # seconds: the slowest rank
            else:
                merged[key] = value
    return merged



class SleepAndWeightsMixin:
    """Mixed into AsyncEngine; relies on its ``core``, ``executor``, ``config`` and ``_require_core``."""

    config: EngineConfig
    core: EngineCore | None
    executor: Executor | None
    _control_lock: Any
    _asleep: set[str]
    _sleep_level: int
    weights_valid: bool
    # The host class also provides _require_core() and collective_rpc().

    async def sleep(self, level: int = 1, mode: str = "wait") -> dict[str, Any]:
        """Frees the engine's device memory so another tenant can use it.

        level 1 keeps a host copy of the weights; level 2 discards them (load them again with
        ``reload_weights`` or ``update_weights`` after ``wake_up``). ``mode`` says what happens to
        requests in flight: "wait" finishes them first, "abort" ends them (finish_reason "abort"),
        "keep" preempts them and they continue after wake, recomputing their KV. Requests submitted
        while asleep wait and run after wake. Returns bytes freed per tag, seconds and notes.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if mode not in ("wait", "abort", "keep"):
            raise ValueError(f"sleep mode must be 'wait', 'abort' or 'keep', got {mode!r}")
        async with self._control_lock:
            core = self._require_core()
            if self._asleep:
                return {"level": self._sleep_level, "mode": mode, "freed_bytes": {"weights": 0, "kv_cache": 0},
                        "seconds": 0.0, "notes": [f"already asleep (level {self._sleep_level}); nothing done"]}  # fmt: skip
            start = time.perf_counter()
            aborted = preempted = 0
            notes = []
            was_paused = core.paused
            core.hold_admission = True
            try:
                if mode == "abort":
                    aborted = core.abort_all()
                elif mode == "wait" and was_paused:
                    # A paused core (weights discarded and not reloaded yet) runs no step, so a drain would
                    # never end. Its queued requests have not started: they stay queued for the next wake.
                    notes.append("engine was paused (weights not loaded): queued requests stay queued")
                elif mode == "wait":
                    await core.drain()
                await core.pause()
                if mode == "keep":
                    preempted = core.scheduler.preempt_all()
                reports = await self.collective_rpc("sleep", (level,))
            except BaseException:
                core.undo_pause(was_paused)
                raise
            core.release_held()  # queued in the scheduler; the paused core runs nothing until wake
            self._asleep = {"weights", "kv_cache"}
            self._sleep_level = level
            if level == 2:
                self.weights_valid = False
            report = merge_reports(reports)
            report.update(level=level, mode=mode, aborted=aborted, preempted=preempted,
                          seconds=time.perf_counter() - start)  # fmt: skip
            report.setdefault("notes", []).extend(notes)
            logger.info("asleep (level %d): freed %s in %.3fs", level, report["freed_bytes"], report["seconds"])
            return report

    async def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Restores "weights" and/or "kv_cache" (default both). Scheduling resumes only once every
        tag is awake (and, after level 2, the weights were loaded again)."""
        wanted = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = sorted(set(wanted) - {"weights", "kv_cache"})
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; known tags: ['weights', 'kv_cache']")
        async with self._control_lock:
            core = self._require_core()
            todo = [t for t in wanted if t in self._asleep]
            if not todo:
                return {"restored_bytes": {"weights": 0, "kv_cache": 0}, "seconds": 0.0,
                        "notes": [f"already awake: {sorted(wanted)}"], "asleep": sorted(self._asleep)}  # fmt: skip
            start = time.perf_counter()
            report = merge_reports(await self.collective_rpc("wake_up", (todo,)))
            self._asleep.difference_update(todo)
            report.update(seconds=time.perf_counter() - start, asleep=sorted(self._asleep))
            if not self.weights_valid:
                report.setdefault("notes", []).append("weights were discarded (level 2): call reload_weights()")
            self._maybe_resume(core)
            return report

    async def is_sleeping(self) -> bool:
        """True until every tag is awake."""
        return bool(self._asleep)

    async def reload_weights(self, mode: str = "pause") -> dict[str, Any]:
        """Loads the configured checkpoint into the model again, in place (e.g. after sleep level 2)."""
        return await self.update_weights(self.config.model.path, mode=mode)

    async def update_weights(
        self, source: Any, mode: str = "pause", partial: bool = False, stage: bool = False
    ) -> dict[str, Any]:
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
        only the copy. Returns tensors, bytes, seconds and the pause requests saw.
        """
        if mode not in ("pause", "drain", "abort", "recompute"):
            raise ValueError(f"update_weights mode must be 'pause', 'drain', 'abort' or 'recompute', got {mode!r}")
        async with self._control_lock:
            core = self._require_core()
            if "weights" in self._asleep:
                raise InvalidRequestError("the weights are asleep: wake_up(tags=['weights']) first, then update them")
            if mode == "drain" and core.paused and core.scheduler.has_unfinished_requests():
                # A paused core (KV cache asleep, or weights not reloaded) runs no step: a drain would never end.
                raise InvalidRequestError(
                    f"mode='drain' cannot finish the {len(core.scheduler.requests)} queued requests while the engine "
                    "is asleep or its weights are not loaded; use mode='pause' (they run on the new weights), "
                    "or wake_up() first"
                )
            start = time.perf_counter()
            assert self.executor is not None
            if stage:
                await self.executor.run_aside("stage_weights", (source, partial))
                source = None  # each worker applies what it staged
            was_paused = core.paused
            aborted = preempted = 0
            if mode in ("drain", "abort"):
                core.hold_admission = True
            try:
                if mode == "drain":
                    await core.drain()
                elif mode == "abort":
                    aborted = core.abort_all()
                pause_start = time.perf_counter()
                await core.pause()
                if mode == "recompute":
                    preempted = core.scheduler.preempt_all()
                report = merge_reports(await self.executor.collective_rpc("update_weights", (source, partial)))
            except BaseException:
                core.undo_pause(was_paused)
                raise
            core.weights_version += 1
            if not partial:
                self.weights_valid = True
            core.release_held()
            self._maybe_resume(core)
            report.update(mode=mode, aborted=aborted, preempted=preempted, weights_version=core.weights_version,
                          pause_seconds=time.perf_counter() - pause_start, seconds=time.perf_counter() - start)  # fmt: skip
            logger.info("weights v%d: %d tensors in %.3fs (requests paused %.3fs)", core.weights_version,
                        report.get("tensors", 0), report["seconds"], report["pause_seconds"])  # fmt: skip
            return report

    @property
    def weights_version(self) -> int:
        """+1 per successful weight update; outputs carry the version they were computed with."""
        return self.core.weights_version if self.core is not None else 0

    def _maybe_resume(self, core: EngineCore) -> None:
        if not self._asleep and self.weights_valid:
            core.resume()

