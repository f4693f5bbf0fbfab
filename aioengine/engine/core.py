"""EngineCore: the step loop on the event loop, and the one way control calls stop it between steps.

A step is schedule -> submit -> publish. The forward runs on the workers while the loop awaits
its future, so other coroutines keep running during every step. With async scheduling (the
default) one step stays queued behind the running one: step N+1 is scheduled and submitted as
soon as step N's outputs are applied (its inputs name N's tokens by placeholder), so the workers
go from step to step without waiting for the loop; publishing N's outputs overlaps N+1's forward.

Control calls (sleep, wake, weight updates) take ``core.control()``: one at a time, they hold the
loop between two steps in a defined way (``ControlSession.quiesce``) and run their worker call
shielded (``ControlSession.run``), and leaving the session always lets the loop go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Literal, TypeVar

from aioengine.engine.outputs import IncrementalDetokenizer, OutputCollector, RequestOutput
from aioengine.engine.state import MemoryState
from aioengine.errors import EngineDeadError, EngineStateError, RequestAbortedError
from aioengine.executor.base import Executor
from aioengine.messages import ModelRunnerOutput, SchedulerOutput, WorkerWeightsReport
from aioengine.scheduler.request import Request, RequestStatus
from aioengine.scheduler.scheduler import RequestUpdate, Scheduler

logger = logging.getLogger(__name__)

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
        """Stops the loop between two steps; returns once no step is in flight.

        "drain" on an engine that cannot serve (asleep, weights discarded) raises EngineStateError
        with queued requests, since they could never finish.
        """
        core = self._core
        if mode == "drain":
            if not core.memory.can_serve and core.scheduler.has_unfinished_requests():
                raise EngineStateError(
                    f"cannot drain: {core.memory.why_not_serving()}, so the "
                    f"{len(core.scheduler.requests)} queued requests could never finish; choose another mode"
                )
            core._hold_admission = True  # new requests wait in `held` until the session ends
            await core._until_idle()
        elif mode == "abort":
            self.aborted = core.abort_all()
        core._quiesced = True
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


class EngineCore:
    """Owns the scheduler, the per-request output state and the memory state; drives the executor."""

    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer: Any, async_scheduling: bool = True) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_queued_steps = 1 if async_scheduling else 0
        """Steps left in flight between two loop turns: the one queued behind the running one."""
        self.collectors: dict[str, OutputCollector] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.memory = MemoryState()
        self.weights_version = 0
        """The newest weights version a worker reported (the workers count the writes)."""
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.worker_seconds = 0.0
        """Time rank 0 spent in forward + sampling; wall time minus this is the engine's overhead."""
        self.dead: BaseException | None = None
        self.held: list[Request] = []
        """Requests that arrived while a drain holds admission; admitted when the session ends."""
        self._hold_admission = False
        self._quiesced = False
        self._control_lock = asyncio.Lock()
        self._pending: list[tuple[int, list[RequestUpdate]]] = []
        """Applied step outputs not published yet: (weights version, updates) per step."""
        self._inflight: deque[tuple[SchedulerOutput, asyncio.Future[ModelRunnerOutput]]] = deque()
        """Steps submitted whose outputs are not applied yet, oldest first."""
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        """Set while the loop is parked with no step in flight (nothing to do, or not allowed to step)."""
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, request: Request) -> OutputCollector:
        if self.dead is not None:
            raise EngineDeadError(f"engine is not running ({self.dead}); create a new one") from self.dead
        params = request.sampling
        if self._hold_admission:
            self.held.append(request)
        else:
            self.scheduler.add_request(request)
            self._kick()
        self.detokenizers[request.req_id] = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
        )
        collector = self.collectors[request.req_id] = OutputCollector()
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
        self._kick()
        return bool(done)

    def release_stream(self, req_id: str, collector: OutputCollector) -> None:
        """A stream closed before its last output: aborts its request, if the id is still that stream's
        (a finished request's id may already serve a new request, which must not be touched)."""
        if self.collectors.get(req_id) is collector:
            self.abort(req_id, notify=False)

    def abort_all(self) -> int:
        """Aborts every accepted request (each stream ends with finish_reason "abort"); returns how many."""
        ids = list(self.scheduler.requests) + [r.req_id for r in self.held]
        return sum(self.abort(req_id) for req_id in ids)

    def _drop(self, req_id: str) -> None:
        self.collectors.pop(req_id, None)
        self.detokenizers.pop(req_id, None)

    # ---- control -------------------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        """A control session holds new requests back while the accepted ones finish."""
        return self._hold_admission and not self._quiesced

    @property
    def can_step(self) -> bool:
        return not self._quiesced and self.memory.can_serve

    @contextlib.asynccontextmanager
    async def control(self) -> AsyncIterator[ControlSession]:
        """One control call at a time. Leaving the session, by success or by error, is the one way back:
        held requests are admitted and the loop steps again if the memory state allows (a failed call
        changed no state, so this is its rollback too). A worker call still running for a cancelled
        caller keeps the session until it ends."""
        await self._control_lock.acquire()
        session = ControlSession(self)
        try:
            yield session
        finally:
            outstanding = session._outstanding
            if outstanding is None:
                self._end_control()
            else:
                outstanding.add_done_callback(self._end_abandoned_control)

    def _end_abandoned_control(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("a control call whose caller was cancelled failed: %r", task.exception())
        self._end_control()

    def _end_control(self) -> None:
        self._quiesced = False
        self._hold_admission = False
        held, self.held = self.held, []
        for request in held:
            self.scheduler.add_request(request)
        self._kick()
        self._control_lock.release()

    def set_memory(self, memory: MemoryState) -> None:
        """Records what a control call did to the workers' memory (only after the call succeeded)."""
        self.memory = memory
        self._kick()

    def weights_written(self, report: WorkerWeightsReport) -> None:
        """A worker wrote weights (update_weights, or an extension through collective_rpc): take its
        version, and serve again once a full write made discarded weights valid. Anything computed from
        the old weights and kept for reuse is dropped here (the prefix cache, once it exists)."""
        self.weights_version = max(self.weights_version, report.weights_version)
        if report.weights_valid != self.memory.weights_valid:
            self.set_memory(self.memory.with_weights(report.weights_valid))

    def weights_lost(self) -> None:
        """A worker's weight write broke half-way (WeightsLostError): no step runs until a full write."""
        self.set_memory(self.memory.with_weights(False))

    async def _until_idle(self) -> None:
        await self._idle.wait()
        if self.dead is not None:
            raise EngineDeadError(f"engine died: {self.dead}") from self.dead

    def _kick(self) -> None:
        """Something changed that may give the loop work: it re-evaluates (and is not idle until it did)."""
        if self.dead is None:
            self._idle.clear()
        self._wake.set()

    # ---- the loop ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="aioengine-core")

    async def _run(self) -> None:
        try:
            while True:
                if self.can_step and self.scheduler.has_unfinished_requests() and await self.step():
                    continue
                if self._inflight:  # not stepping: finish the queued steps first
                    await self._finish_oldest(publish_first=True)
                    continue
                self._flush()
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # any failure of a step ends every stream, never hangs it
            logger.exception("engine step failed; the engine is dead")
            self.fail(EngineDeadError(f"engine step failed: {type(exc).__name__}: {exc}"), cause=exc)

    async def step(self) -> bool:
        """schedule -> submit -> publish. False when nothing could be scheduled and no step is in flight."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if not self._inflight:
                return False  # nothing fits until a request comes or goes: park
            await self._finish_oldest(publish_first=True)  # everything running waits on the step in flight
            return True
        self._inflight.append((sched, self.executor.submit_step(sched)))
        # Publish the last step's outputs while the workers compute. Stop strings are found here, so
        # such a request may run a step or two more; the extra tokens are dropped.
        self._flush()
        while len(self._inflight) > self.max_queued_steps:
            await self._finish_oldest()
        return True

    async def _finish_oldest(self, publish_first: bool = False) -> None:
        """Applies the oldest step's outputs once it is done (workers run steps in order)."""
        if publish_first:
            self._flush()
            await asyncio.sleep(0)  # let streams take them, else one output would merge two steps' tokens
        sched, forward = self._inflight[0]
        output = await forward
        self._inflight.popleft()
        self.num_steps += 1
        self.worker_seconds += output.forward_seconds
        self.weights_version = max(self.weights_version, output.weights_version)
        self._pending.append((output.weights_version, self.scheduler.update_from_output(sched, output)))

    def _flush(self) -> None:
        """Publishes the updates of the applied steps (detokenizing, applying stop strings)."""
        pending, self._pending = self._pending, []
        for version, updates in pending:
            for update in updates:
                self._publish_update(update, version)

    def _publish_update(self, update: RequestUpdate, weights_version: int) -> None:
        request = update.request
        self.num_generated_tokens += len(update.new_token_ids)
        detok = self.detokenizers.get(request.req_id)
        if detok is None or request.status == RequestStatus.FINISHED_ABORTED:
            return  # aborted after this update was made; its stream already ended
        delta, hit = detok.add(update.new_token_ids, update.finished)
        if hit is not None:
            request.stop_reason = hit
            if not update.finished:
                self.scheduler.finish_requests([request.req_id], RequestStatus.FINISHED_STOPPED)
            else:
                request.status = RequestStatus.FINISHED_STOPPED
        finished = request.status.is_finished
        self._publish(request, update.new_token_ids, delta, finished, weights_version=weights_version)
        if finished:
            self._drop(request.req_id)

    def _publish(
        self,
        request: Request,
        new_ids: list[int],
        delta: str,
        finished: bool,
        notify: bool = True,
        weights_version: int | None = None,
    ) -> None:
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
                weights_version=self.weights_version if weights_version is None else weights_version,
                num_preemptions=request.num_preemptions,
            )
        )

    def fail(self, error: BaseException, cause: BaseException | None = None) -> None:
        """Marks the engine dead and ends every stream with ``error``."""
        if self.dead is None:
            self.dead = error
        error.__cause__ = cause
        for req_id, collector in self.collectors.items():
            aborted = RequestAbortedError(f"request {req_id!r} did not finish: {error}")
            aborted.__cause__ = error
            collector.put(aborted)
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
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.dead is None:
            self.fail(EngineDeadError("engine was shut down"))
