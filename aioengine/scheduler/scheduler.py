"""Continuous batching with a token budget per step, chunked prefill and preemption by recompute.

Each step the running requests go first (a decode token each, or the next prefill chunk), in
arrival order; then waiting requests are admitted while the budget, ``max_num_seqs`` and free
blocks allow. When blocks run out, the most recently admitted running request is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed later, so no
request is ever lost and the oldest request always makes progress (no deadlock).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from aioengine.messages import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from aioengine.scheduler.kv_manager import KVBlockManager
from aioengine.scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class RequestUpdate:
    """What one step did for one request: the new token (if any) and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    """Decides which requests run each step and keeps their KV blocks."""

    def __init__(
        self,
        num_cache_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.kv = KVBlockManager(num_cache_blocks, block_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._step_ids = itertools.count()
        self._scheduled: dict[int, dict[str, Request]] = {}
        """Step id -> the requests it ran, until its outputs are applied: a request aborted while its step
        ran may come back under the same id, and the old step's token must not reach the new one."""
        self.num_preemptions = 0

    # ---- queue ---------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in flight")
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests (abort, stop string, ...) and frees their blocks; unknown ids are ignored."""
        done = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            done.append(request)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(len(request.token_ids) + request.num_placeholders - request.num_computed_tokens, budget)
            if num_new <= 0 or self._ends_in_flight(request):
                i += 1  # the step in flight samples its last token: nothing more to run
                continue
            while not self.kv.allocate(request, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted; everything after it already was

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            request = self.waiting[0]
            remaining = len(request.token_ids) - request.num_computed_tokens
            num_new = min(remaining, budget)
            if num_new < remaining and not self.enable_chunked_prefill:
                break
            if not self.kv.allocate(request, request.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

        step_id = next(self._step_ids)
        if scheduled:
            self._scheduled[step_id] = {r.req_id: r for r, _ in scheduled}
        return SchedulerOutput(step_id=step_id, requests=[self._describe(r, n) for r, n in scheduled])

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether a token still to come back reaches the request's length limit (async scheduling)."""
        pending = request.num_placeholders
        return pending > 0 and (
            request.num_output_tokens + pending >= request.sampling.max_tokens
            or len(request.token_ids) + pending >= self.max_model_len
        )

    def _describe(self, request: Request, num_new: int) -> ScheduledRequest:
        """The step's share of ``request``; advances its computed tokens (and placeholders, if it samples)."""
        start = request.num_computed_tokens
        end = start + num_new
        known = request.token_ids[start:end]
        samples = end == len(request.token_ids) + request.num_placeholders
        scheduled = ScheduledRequest(
            req_id=request.req_id,
            # past the known tokens: the one the step in flight samples
            token_ids=known + [PLACEHOLDER_TOKEN_ID] * (num_new - len(known)),
            start_pos=start,
            block_ids=list(request.block_ids),
            sampling=request.sampling if samples else None,
            output_index=request.num_output_tokens + request.num_placeholders,
        )
        request.num_computed_tokens = end
        request.num_placeholders += samples
        return scheduled

    def update_from_output(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Appends the sampled tokens (in place of their placeholders) and applies stop conditions."""
        updates = []
        ran = self._scheduled.pop(sched.step_id, {})
        for req_id, token in zip(output.req_ids, output.sampled_token_ids, strict=True):
            request = ran.get(req_id)
            if (
                request is None
                or self.requests.get(req_id) is not request
                or request.status != RequestStatus.RUNNING
                or not request.num_placeholders
            ):
                continue  # aborted, finished or preempted while the step ran: the token is dropped
            request.num_placeholders -= 1
            request.token_ids.append(token)
            status = self._check_stop(request, token)
            if status is not None:
                self.running.remove(request)
                request.status = status
                self._release(request)
            updates.append(RequestUpdate(request, [token], status is not None))
        return updates

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling
        n = request.num_output_tokens
        if n >= params.min_tokens:
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if n >= params.max_tokens or len(request.token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def preempt_all(self) -> int:
        """Preempts every running request (KV recomputed later, outputs kept); returns how many."""
        count = len(self.running)
        while self.running:
            self._preempt(self.running.pop())  # newest first, so the oldest ends up at the front
        return count

    # ---- internals ---------------------------------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_placeholders = 0  # tokens of steps in flight are dropped; recompute samples them again
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.req_id]
