"""Sleep / wake, hot weight swap, pause / resume: the engine-side control of the workers' memory and
weights, and of generation itself.

Every operation is one ``EngineCore.control()`` session: it quiesces the loop by a mode chosen
from the caller's, runs the worker call shielded (a caller that is cancelled or times out does
not leave the engine half-way), records the outcome in the core's ``MemoryState``, and leaves.
A pause is the one state that outlives its session (``core.paused``): the loop stays held until
a resume, and the other calls work under it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from aioengine.engine.core import EngineCore, QuiesceMode
from aioengine.errors import EngineStateError, WeightsLostError
from aioengine.messages import (
    SleepLevel,
    TagBytes,
    WakeTag,
    WorkerSleepReport,
    WorkerWakeReport,
    WorkerWeightsReport,
    check_choice,
    check_tags,
)

if TYPE_CHECKING:
    from aioengine.executor.base import Executor

logger = logging.getLogger(__name__)

SleepMode = Literal["wait", "abort", "keep"]
"""Requests in flight at a sleep: "wait" finishes them first, "abort" ends them, "keep" preempts them
(they continue after wake, recomputing their KV)."""
UpdateMode = Literal["pause", "drain", "abort", "recompute"]
"""Requests in flight at a weight update: "pause" swaps between two steps (they go on with the new
weights), "drain" finishes them on the old weights first, "abort" ends them, "recompute" drops their
KV and recomputes it under the new weights."""

PauseMode = Literal["abort", "wait", "keep"]
"""Requests in flight at pause_generation: "abort" ends them (and the queued ones), "wait" finishes them
first (new ones wait), "keep" freezes them between two steps with their KV (they go on unchanged on resume)."""

_SLEEP_QUIESCE: dict[str, QuiesceMode] = {"wait": "drain", "abort": "abort", "keep": "preempt"}
_UPDATE_QUIESCE: dict[str, QuiesceMode] = {"pause": "pause", "drain": "drain", "abort": "abort", "recompute": "preempt"}
_PAUSE_QUIESCE: dict[str, QuiesceMode] = {"abort": "abort", "wait": "drain", "keep": "pause"}


@dataclass(frozen=True, slots=True)
class SleepReport:
    """What ``sleep`` did."""

    level: SleepLevel
    mode: SleepMode
    freed_bytes: TagBytes
    seconds: float
    aborted: int = 0
    preempted: int = 0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PauseReport:
    """What ``pause_generation`` did."""

    mode: PauseMode
    aborted: int
    seconds: float
    """From the call to the pause taking hold: the drain ("wait") or the step in flight."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WakeReport:
    """What ``wake_up`` did, and what is still asleep."""

    restored_bytes: TagBytes
    seconds: float
    asleep: tuple[WakeTag, ...]
    graph_capture_seconds: float = 0.0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WeightUpdateReport:
    """What ``update_weights`` wrote and what requests in flight saw."""

    mode: UpdateMode
    tensors: int
    bytes: int
    weights_version: int
    seconds: float
    """The whole call, staging included."""
    pause_seconds: float
    """How long no step ran: the quiesce plus the write."""
    aborted: int = 0
    preempted: int = 0


class EngineControl:
    """sleep / wake_up / update_weights / pause_generation / resume_generation over one core and its executor."""

    def __init__(self, core: EngineCore, executor: Executor) -> None:
        self.core = core
        self.executor = executor

    async def sleep(self, level: SleepLevel = 1, mode: SleepMode = "wait") -> SleepReport:
        check_choice("sleep level", level, SleepLevel)
        check_choice("sleep mode", mode, SleepMode)
        core = self.core
        start = time.perf_counter()
        async with core.control() as session:
            if core.memory.is_sleeping:
                note = f"already asleep (level {core.memory.level}); nothing done"
                return SleepReport(core.memory.level or level, mode, TagBytes(), 0.0, notes=(note,))
            quiesce, notes = _SLEEP_QUIESCE[mode], []
            if quiesce == "drain" and not core.memory.can_serve:
                # No step runs on discarded weights, so nothing could drain: they wait for the next wake.
                quiesce = "pause"
                notes.append("the weights are not loaded, so no request could finish: queued requests stay queued")
            await session.quiesce(quiesce)

            async def on_workers() -> WorkerSleepReport:
                report = WorkerSleepReport.merge(await self.executor.collective_rpc("sleep", (level,)))
                core.kv_changed()  # the KV cache, host pool included, was freed
                core.set_memory(core.memory.fell_asleep(level))
                return report

            worker = await session.run(on_workers())
        report = SleepReport(
            level,
            mode,
            worker.freed_bytes,
            time.perf_counter() - start,
            session.aborted,
            session.preempted,
            (*worker.notes, *notes),
        )
        logger.info("asleep (level %d): freed %s in %.3fs", level, report.freed_bytes, report.seconds)
        return report

    async def wake_up(self, tags: Iterable[str] | None = None) -> WakeReport:
        wanted = check_tags(tags)
        core = self.core
        async with core.control() as session:
            todo = tuple(t for t in wanted if t in core.memory.asleep)
            if not todo:
                return WakeReport(
                    TagBytes(), 0.0, tuple(sorted(core.memory.asleep)), notes=(f"already awake: {list(wanted)}",)
                )
            await session.quiesce("pause")  # nothing runs while asleep: this only orders the call

            async def on_workers() -> WorkerWakeReport:
                report = WorkerWakeReport.merge(await self.executor.collective_rpc("wake_up", (list(todo),)))
                core.set_memory(core.memory.woke(todo))
                return report

            worker = await session.run(on_workers())
        asleep = tuple(sorted(core.memory.asleep))
        notes = (
            worker.notes
            if core.memory.weights_valid
            else (*worker.notes, "weights were discarded (level 2): call reload_weights() or update_weights()")
        )
        return WakeReport(
            worker.restored_bytes, worker.seconds, asleep, worker.graph_capture_seconds, tuple(dict.fromkeys(notes))
        )

    async def update_weights(
        self,
        source: Any,
        mode: UpdateMode = "pause",
        partial: bool = False,
        stage: bool = False,
        allow_non_finite: bool = False,
    ) -> WeightUpdateReport:
        check_choice("update_weights mode", mode, UpdateMode)
        core = self.core
        start = time.perf_counter()
        async with core.control() as session:
            if "weights" in core.memory.asleep:
                raise EngineStateError("the weights are asleep: wake_up(tags=['weights']) first, then update them")
            if stage:
                await session.run(self.executor.run_aside("stage_weights", (source, partial, allow_non_finite)))
                source = None  # each worker applies what it staged
            pause_start = time.perf_counter()
            await session.quiesce(_UPDATE_QUIESCE[mode])

            async def on_workers() -> WorkerWeightsReport:
                try:
                    replies = await self.executor.collective_rpc("update_weights", (source, partial, allow_non_finite))
                except WeightsLostError:
                    core.weights_lost()
                    raise
                report = WorkerWeightsReport.merge(replies)
                core.weights_written(report)
                return report

            worker = await session.run(on_workers())
            pause_seconds = time.perf_counter() - pause_start
        report = WeightUpdateReport(
            mode,
            worker.tensors,
            worker.bytes,
            worker.weights_version,
            time.perf_counter() - start,
            pause_seconds,
            session.aborted,
            session.preempted,
        )
        logger.info(
            "weights v%d: %d tensors in %.3fs (requests paused %.3fs)",
            report.weights_version,
            report.tensors,
            report.seconds,
            report.pause_seconds,
        )
        return report

    async def pause_generation(self, mode: PauseMode = "abort") -> PauseReport:
        check_choice("pause mode", mode, PauseMode)
        core = self.core
        start = time.perf_counter()
        async with core.control() as session:
            was_paused = core.paused
            await session.quiesce(_PAUSE_QUIESCE[mode])  # "drain" refuses while paused with requests queued
            core.set_paused(True)  # no await since the quiesce: a cancelled caller paused nothing
        report = PauseReport(
            mode, session.aborted, time.perf_counter() - start, ("already paused",) if was_paused else ()
        )
        logger.info("generation paused (%s): %d aborted, %.3fs", mode, report.aborted, report.seconds)
        return report

    async def resume_generation(self) -> None:
        core = self.core
        async with core.control():  # after any control call in progress, so it resumes what that call left
            if core.paused:
                core.set_paused(False)
                logger.info("generation resumed")
