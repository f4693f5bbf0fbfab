"""EngineCore: the step loop on the event loop, and the one way control calls stop it between steps.

A step is schedule -> submit -> publish. The forward runs on the workers while the loop awaits
its future, so other coroutines keep running during every step. With async scheduling (the
default) one step stays queued behind the running one: step N+1 is scheduled and submitted as
soon as step N's outputs are applied (its inputs name N's tokens by placeholder), so the workers
go from step to step without waiting for the loop; publishing N's outputs overlaps N+1's forward.

Control calls (sleep, wake, weight updates, pause / resume) take ``core.control()``: one at a time,
they hold the loop between two steps in a defined way (``ControlSession.quiesce``) and run their
worker call shielded (``ControlSession.run``), and leaving the session always lets the loop go on,
unless the call paused generation (``core.paused``): that holds until a resume. ``ControlSession`` and
``QuiesceMode`` are in ``aioengine.engine.control_session``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from aioengine.engine.control_session import ControlSession, QuiesceMode
from aioengine.engine.outputs import IncrementalDetokenizer, OutputCollector
from aioengine.engine.request_state import RequestKind, RequestState
from aioengine.engine.state import MemoryState
from aioengine.errors import EngineDeadError, InvalidRequestError, RequestAbortedError
from aioengine.executor.base import Executor
from aioengine.messages import ModelRunnerOutput, SchedulerOutput, WorkerWeightsReport
from aioengine.scheduler.request import Request, RequestStatus
from aioengine.scheduler.scheduler import RequestUpdate, Scheduler

__all__ = ["ControlSession", "EngineCore", "QuiesceMode"]

logger = logging.getLogger(__name__)

_ABORTED = RequestStatus.FINISHED_ABORTED


class EngineCore:
    """Owns the scheduler, the per-request output state and the memory state; drives the executor."""

    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer: Any, async_scheduling: bool = True) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_queued_steps = 1 if async_scheduling else 0
        """Steps left in flight between two loop turns: the one queued behind the running one."""
        self.states: dict[str, RequestState] = {}
        """The output side of every accepted request, by the id it was submitted with."""
        self._token_texts: dict[int, str] = {}
        self._vocab_limit = len(tokenizer) if tokenizer is not None else 0
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
        self._paused = False
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
    def add_request(
        self, request: Request, kind: RequestKind = "generate", num_scored_from: int = 0
    ) -> OutputCollector:
        """Accepts a request: ``request`` and the sequences of its group parked in ``request.followers``
        (its ``n`` samples, or the continuations a score rates). Returns the request's stream."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is not running ({self.dead}); create a new one") from self.dead
        params = request.sampling
        sequences = [request, *request.followers]
        held = {r.req_id for leader in self.held for r in (leader, *leader.followers)}
        taken = next((r.req_id for r in sequences if r.req_id in self.scheduler.requests or r.req_id in held), None)
        if request.group_id in self.states or taken is not None:
            raise InvalidRequestError(f"request id {request.group_id!r} is already in flight")
        detokenizers = [
            IncrementalDetokenizer(
                self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
            )
            if params.detokenize
            else None
            for _ in sequences
        ]
        state = RequestState(sequences, detokenizers, self.token_text, kind, num_scored_from)
        if self._hold_admission:
            self.held.append(request)
        else:
            self.scheduler.add_request(request)
            self._admit_before_a_queued_window()
            self._kick()
        self.states[request.group_id] = state
        return state.collector

    def _admit_before_a_queued_window(self) -> None:
        """A request that has a seat to take does not wait for a decode window queued behind the running step: the
        window is taken back (where no worker has started it) and its sequences are scheduled again with the new one,
        whose first token then waits for the running step alone."""
        scheduler = self.scheduler
        if (
            len(self._inflight) > 1
            and self._inflight[-1][0].num_steps > 1
            and scheduler.num_running < scheduler.max_num_seqs
        ):
            self.revoke_queued_step()

    def token_text(self, token_id: int) -> str:
        """A token's text on its own (for logprobs); cached, since the same tokens come back all the time."""
        text = self._token_texts.get(token_id)
        if text is None:
            in_vocab = 0 <= token_id < self._vocab_limit
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id]) if in_vocab else ""
        return text

    def abort(self, req_id: str, notify: bool = True) -> bool:
        """Finishes every unfinished sequence of a request with reason "abort"; its stream gets a last
        output if ``notify``. False if no such request is in flight."""
        state = self.states.get(req_id)
        if state is None:
            return False
        sequences = state.sequences
        self.scheduler.finish_requests([r.req_id for r in sequences], RequestStatus.FINISHED_ABORTED)
        self.held = [r for r in self.held if r.group_id != req_id]
        for request in sequences:  # held or parked ones never reached the scheduler's lists
            if not request.status.is_finished:
                request.status = RequestStatus.FINISHED_ABORTED
        if notify:
            state.collector.put(state.output(self.weights_version))
        self._drop(req_id)
        self._kick()
        return True

    def release_stream(self, req_id: str, collector: OutputCollector) -> None:
        """A stream closed before its last output: aborts its request, if the id is still that stream's
        (a finished request's id may already serve a new request, which must not be touched)."""
        state = self.states.get(req_id)
        if state is not None and state.collector is collector:
            self.abort(req_id, notify=False)

    def abort_all(self) -> int:
        """Aborts every accepted request (each stream ends with finish_reason "abort"); returns how many."""
        return sum(self.abort(req_id) for req_id in list(self.states))

    def _drop(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    # ---- control -------------------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        """A control session holds new requests back while the accepted ones finish."""
        return self._hold_admission and not self._quiesced

    @property
    def paused(self) -> bool:
        """Generation is paused (pause_generation) until resume_generation: no step runs, requests wait."""
        return self._paused

    @property
    def can_step(self) -> bool:
        return not self._quiesced and not self._paused and self.memory.can_serve

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

    def set_paused(self, paused: bool) -> None:
        """Records a pause or resume of generation (inside its control session); outlives the session."""
        self._paused = paused
        self._kick()

    def set_memory(self, memory: MemoryState) -> None:
        """Records what a control call did to the workers' memory (only after the call succeeded)."""
        self.memory = memory
        self._kick()

    def weights_written(self, report: WorkerWeightsReport) -> None:
        """A worker wrote weights (update_weights, or an extension through collective_rpc): take its
        version, and serve again once a full write made discarded weights valid. KV computed from the old
        weights and kept for reuse is dropped (``kv_changed``)."""
        self.weights_version = max(self.weights_version, report.weights_version)
        self.kv_changed()
        if report.weights_valid != self.memory.weights_valid:
            self.set_memory(self.memory.with_weights(report.weights_valid))

    def weights_lost(self) -> None:
        """A worker's weight write broke half-way (WeightsLostError): no step runs until a full write."""
        self.kv_changed()
        self.set_memory(self.memory.with_weights(False))

    def kv_changed(self) -> None:
        """The KV kept for reuse no longer matches the weights, or a sleep freed it: the prefix cache is
        emptied and swapped-out requests recompute."""
        self.drop_prefix_cache()
        self.scheduler.drop_swapped()

    def drop_prefix_cache(self) -> int:
        """Forgets every cached prefix, because the KV would differ now (new weights, a sleep freed it) or a
        caller asked; returns how many blocks were cached. Requests in flight keep their blocks, and never
        offer them to the cache again (they were computed before)."""
        return self.scheduler.kv.reset(self.weights_version)

    def revoke_queued_step(self) -> bool:
        """Takes back the step queued behind the running one, if no worker has started it and the scheduler
        can undo it (``Scheduler.revocable``): a control call that stops the loop then waits for one step,
        not two, and the requests of the revoked step run it after the call. True if one was revoked."""
        if len(self._inflight) < 2:  # the oldest is the one the loop awaits: never that one
            return False
        sched, step = self._inflight[-1]
        if not self.scheduler.revocable(sched.step_id) or not self.executor.withdraw_step(step):
            return False
        self._inflight.pop()
        self.scheduler.revoke(sched.step_id)
        return True

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
        """Publishes the updates of the applied steps (detokenizing, applying stop strings): one output
        per request and step, whatever number of its sequences the step advanced."""
        pending, self._pending = self._pending, []
        for version, updates in pending:
            touched: dict[str, RequestState] = {}
            for update in updates:
                state = self._apply_update(update)
                if state is not None:
                    touched[state.request_id] = state
            for state in touched.values():
                finished = state.finished
                if state.final_only and not finished:
                    continue  # one output, once every sequence ended (a score: every continuation rated)
                state.collector.put(state.output(version))
                if finished:
                    self._drop(state.request_id)

    def _apply_update(self, update: RequestUpdate) -> RequestState | None:
        """Feeds one sequence's new tokens to its request's output state; None if nobody waits for them."""
        request = update.request
        state = self.states.get(request.group_id)
        if state is None or state.kind == "generate":  # a score's one argmax is not generated text
            self.num_generated_tokens += len(update.new_token_ids)
        if (
            state is None
            or state.samples[request.sample_index].request is not request
            or request.status is _ABORTED  # by identity, a module constant: this runs for every row of every step
        ):
            return None  # aborted after this update was made (its stream already ended), or an old id
        hit = state.add(request, update.new_token_ids, update.finished, update.logprobs)
        if hit is not None:
            request.stop_reason = hit
            if not update.finished:
                self.scheduler.finish_requests([request.req_id], RequestStatus.FINISHED_STOPPED)
            else:
                request.status = RequestStatus.FINISHED_STOPPED
        return state

    def fail(self, error: BaseException, cause: BaseException | None = None) -> None:
        """Marks the engine dead and ends every stream with ``error``."""
        if self.dead is None:
            self.dead = error
        error.__cause__ = cause
        for req_id, state in self.states.items():
            aborted = RequestAbortedError(f"request {req_id!r} did not finish: {error}")
            aborted.__cause__ = error
            state.collector.put(aborted)
        self.states.clear()
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
