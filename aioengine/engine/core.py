"""EngineCore: the step loop on the event loop. schedule -> await execute -> publish.

It never runs torch compute: the forward happens on the worker thread while the loop
awaits its future, so other coroutines keep running during every step.

With async scheduling (the default) the loop keeps one step queued behind the running one:
it schedules and submits step N+1 as soon as step N's outputs are applied, while N+1's own
inputs still name N's tokens by placeholder, so the worker goes from step to step without
waiting for the loop; publishing step N's outputs overlaps step N+1's forward.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from typing import Any

from aioengine.engine.outputs import IncrementalDetokenizer, OutputCollector, RequestOutput
from aioengine.errors import EngineDeadError
from aioengine.executor.base import Executor
from aioengine.messages import ModelRunnerOutput, SchedulerOutput
from aioengine.scheduler.request import Request, RequestStatus
from aioengine.scheduler.scheduler import RequestUpdate, Scheduler

logger = logging.getLogger(__name__)

_yield_gil = getattr(os, "sched_yield", lambda: None)  # releases the GIL and the CPU (not on Windows)


class EngineCore:
    """Owns the scheduler and the per-request output state; drives the executor step by step."""

    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer: Any, async_scheduling: bool = True) -> None:
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling
        self.executor = executor
        self.tokenizer = tokenizer
        self.collectors: dict[str, OutputCollector] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.weights_version = 0
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.worker_seconds = 0.0
        """Time rank 0 spent in forward + sampling; wall time minus this is the engine's overhead."""
        self.dead: BaseException | None = None
        self.paused = False
        """No steps run while paused (asleep, or swapping weights); requests still queue."""
        self.hold_admission = False
        """New requests wait in ``held`` instead of the scheduler (e.g. while draining before a sleep)."""
        self.held: list[Request] = []
        self._pending: list[RequestUpdate] = []
        self._inflight: deque[tuple[SchedulerOutput, asyncio.Future[ModelRunnerOutput]]] = deque()
        """Steps submitted whose outputs are not applied yet, oldest first (at most one between steps)."""
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, request: Request) -> OutputCollector:
        if self.dead is not None:
            raise EngineDeadError(f"engine is not running ({self.dead}); create a new one") from self.dead
        params = request.sampling
        if self.hold_admission:
            self.held.append(request)
        else:
            self.scheduler.add_request(request)
        self.detokenizers[request.req_id] = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        collector = self.collectors[request.req_id] = OutputCollector()
        self._wake.set()
        return collector

    def abort(self, req_id: str, notify: bool = True) -> bool:
        """Finishes a request with reason "abort"; its stream gets a last output if ``notify``."""
        done = self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        held = [r for r in self.held if r.req_id == req_id]
        for request in held:
            self.held.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
        done += held
        for request in done:
            self._publish(request, [], "", finished=True, notify=notify)
        self._drop(req_id)
        return bool(done)

    def abort_all(self) -> int:
        """Aborts every accepted request (each stream ends with finish_reason "abort"); returns how many."""
        ids = list(self.scheduler.requests) + [r.req_id for r in self.held]
        return sum(self.abort(req_id) for req_id in ids)

    # ---- pausing (sleep, weight swaps) -----------------------------------------------------------------
    async def pause(self) -> None:
        """Stops stepping; returns once the step in flight (if any) has finished."""
        self.paused = True
        await self._idle.wait()

    def resume(self) -> None:
        """Steps again, admitting the requests that were held meanwhile."""
        self.paused = False
        self.release_held()
        self._wake.set()

    def undo_pause(self, was_paused: bool) -> None:
        """After a failed sleep / weight update: admit held requests and step again unless paused before."""
        if self.dead is not None:
            return
        self.release_held()
        if not was_paused:
            self.resume()

    def release_held(self) -> None:
        self.hold_admission = False
        held, self.held = self.held, []
        for request in held:
            self.scheduler.add_request(request)
        self._wake.set()

    async def drain(self) -> None:
        """Returns once every request in the scheduler has finished (new ones should be held first)."""
        while self.scheduler.has_unfinished_requests() and self.dead is None:
            await asyncio.sleep(0.002)
        if self.dead is not None:
            raise EngineDeadError(f"engine died while draining: {self.dead}") from self.dead

    def _drop(self, req_id: str) -> None:
        self.collectors.pop(req_id, None)
        self.detokenizers.pop(req_id, None)

    # ---- the loop ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="aioengine-core")

    async def _run(self) -> None:
        try:
            while True:
                if self.paused or not self.scheduler.has_unfinished_requests():
                    if self._inflight:  # finish the queued step before idling
                        await self._publish_then_finish_oldest()
                        continue
                    self._flush()
                    self._idle.set()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._idle.clear()
                await self._step()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure of a step ends every stream, never hangs it
            logger.exception("engine step failed; the engine is dead")
            self.fail(EngineDeadError(f"engine step failed: {type(exc).__name__}: {exc}"), cause=exc)

    async def _step(self) -> None:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self._inflight:  # everything running waits on the step in flight
                await self._publish_then_finish_oldest()
                return
            self._flush()
            self._wake.clear()  # nothing fits this instant; wait for a change instead of spinning
            try:
                await asyncio.wait_for(self._wake.wait(), 0.01)
            except TimeoutError:
                pass
            return
        forward = asyncio.ensure_future(self.executor.execute_model(sched))
        # One loop turn runs the new task up to its hand-off to the workers (the executor submits
        # before its first real wait); without it the flush below would run before the step starts.
        await asyncio.sleep(0)
        self._inflight.append((sched, forward))
        # Detokenize and publish the last outputs while the worker computes. Stop strings are found
        # here, so such a request may run a step or two more; the extra tokens are dropped.
        self._flush()
        while len(self._inflight) > self.async_scheduling:  # async: leave the new step queued
            await self._finish_oldest()

    async def _publish_then_finish_oldest(self) -> None:
        """Publishes the applied outputs, lets streams take them, then applies the next step's."""
        self._flush()
        await asyncio.sleep(0)  # else a stream could get two steps' tokens merged into one output
        await self._finish_oldest()

    async def _finish_oldest(self) -> None:
        """Waits for the oldest step in flight and applies its outputs (workers run steps in order)."""
        sched, forward = self._inflight[0]
        output = await forward
        if len(self._inflight) > 1:
            # The worker finished this step and has the next one queued, but it woke this thread by
            # finishing, and would wait for the GIL while the code below runs (1.2-1.5 ms a step on
            # 2 cores). Yielding first lets it start the next step; the loop waits for that instead.
            _yield_gil()
        self._inflight.popleft()
        self.num_steps += 1
        self.worker_seconds += output.forward_seconds
        self._pending.extend(self.scheduler.update_from_output(sched, output))

    def _flush(self) -> None:
        """Publishes the updates of the last step (detokenizing, applying stop strings)."""
        updates, self._pending = self._pending, []
        for update in updates:
            request = update.request
            self.num_generated_tokens += len(update.new_token_ids)
            detok = self.detokenizers.get(request.req_id)
            if detok is None:
                continue
            if request.status == RequestStatus.FINISHED_ABORTED:
                continue  # aborted after this update was made; its stream already ended
            delta, hit = detok.add(update.new_token_ids, update.finished)
            if hit is not None:
                request.stop_reason = hit
                if not update.finished:
                    self.scheduler.finish_requests([request.req_id], RequestStatus.FINISHED_STOPPED)
                else:
                    request.status = RequestStatus.FINISHED_STOPPED
            finished = request.status.is_finished
            self._publish(request, update.new_token_ids, delta, finished)
            if finished:
                self._drop(request.req_id)

    def _publish(self, request: Request, new_ids: list[int], delta: str, finished: bool, notify: bool = True) -> None:
        collector = self.collectors.get(request.req_id)
        detok = self.detokenizers.get(request.req_id)
        if collector is None or not notify:
            return
        collector.put(
            RequestOutput(
                request_id=request.req_id,
                prompt_token_ids=request.prompt_token_ids,
                token_ids=request.output_token_ids,
                text=detok.text if detok else "",
                delta_text=delta,
                delta_token_ids=list(new_ids),
                finished=finished,
                finish_reason=request.finish_reason,
                stop_reason=request.stop_reason,
                weights_version=self.weights_version,
                num_preemptions=request.num_preemptions,
            )
        )

    def fail(self, error: BaseException, cause: BaseException | None = None) -> None:
        """Marks the engine dead and ends every stream with ``error``."""
        if self.dead is None:
            self.dead = error
        error.__cause__ = cause
        for collector in self.collectors.values():
            collector.put(error)
        self.collectors.clear()
        self.detokenizers.clear()
        self.held.clear()
        self._pending = []
        self._inflight.clear()
        self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        self._idle.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.dead is None:
            self.fail(EngineDeadError("engine was shut down"))
