"""Continuous batching with a token budget per step, chunked prefill, and preemption by recompute or swap.

Each step the running requests go first (a decode token each, or the next prefill chunk), in
arrival order; then waiting requests are admitted while the budget, ``max_num_seqs`` and free
blocks allow. When blocks run out, the most recently admitted running request is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed later (or, with
``preemption_mode="swap"``, its blocks are copied to the host pool and back when it resumes), so no
request is ever lost and the oldest request always makes progress (no deadlock).

A group of sequences with one prompt (``n`` samples, or the continuations ``score`` rates) is
admitted as its first sequence, the leader, with the others parked on it. Once the leader's step
covers the shared prefix, the others start from it holding the same blocks (reference-counted);
whoever writes into a block it shares gets a copy first (copy-on-write, ``blocks_to_copy``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from aioengine.config import PreemptionMode
from aioengine.messages import LogprobRows, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from aioengine.scheduler.decode_window import DecodeWindows
from aioengine.scheduler.host_pool import HostSwapPool
from aioengine.scheduler.kv_manager import KVBlockManager
from aioengine.scheduler.request import Request, RequestStatus
from aioengine.scheduler.scheduled_request import describe


@dataclass(slots=True)
class RequestUpdate:
    """What one step did for one request: the new token (if any) and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finished: bool
    logprobs: LogprobRows | None = None
    """The new token's logprobs, if the request asked for them."""


@dataclass(slots=True)
class _Revocable:
    """What the newest step changed, kept while it can be revoked before it runs (``Scheduler.revoke``)."""

    step_id: int
    advanced: list[tuple[Request, int, int, int]]
    """Each request it runs: its computed tokens before, the tokens the step samples for it, and its registered
    blocks before."""
    registered: list[int]
    """The blocks it entered in the prefix cache."""


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
        enable_prefix_caching: bool = False,
        preemption_mode: PreemptionMode = "recompute",
        num_host_blocks: int = 0,
        decode_steps: int = 1,
        decode_window_s: float = 0.0,
    ) -> None:
        self.kv = KVBlockManager(num_cache_blocks, block_size, enable_prefix_caching)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._step_ids = itertools.count()
        self._scheduled: dict[int, dict[str, tuple[Request, int]]] = {}
        """Step id -> the requests it ran and their preemption counts, until its outputs are applied: a
        request aborted while its step ran may come back under the same id, and one preempted may be running
        again from a recompute; the old step's token must reach neither."""
        self.num_preemptions = 0
        self.preemption_mode: PreemptionMode = preemption_mode
        self.num_host_blocks = num_host_blocks
        self.host = HostSwapPool(num_host_blocks)
        self.num_swapped_out = 0
        """Preemptions that moved the request's KV to the host pool (the rest recomputed)."""
        self._revocable: _Revocable | None = None
        """The newest step, while revoking it needs nothing but its own record undone."""
        self.num_revoked = 0
        """Steps revoked before they ran (a control call stopped the loop while they were queued)."""
        self.windows = DecodeWindows(decode_steps, decode_window_s)

    # ---- queue ---------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request, and the sequences of its group parked in ``request.followers``."""
        group = [request, *request.followers]
        taken = [r.req_id for r in group if r.req_id in self.requests]
        if taken or len({r.req_id for r in group}) < len(group):
            raise ValueError(f"request id {(taken or [request.req_id])[0]!r} is already in flight")
        for follower in request.followers:
            follower.leader = request
            self.requests[follower.req_id] = follower
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
            elif request.leader is not None:
                request.leader.followers.remove(request)
                request.leader = None
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
    def num_host_blocks_free(self) -> int:
        return self.host.num_free_blocks

    @property
    def num_waiting(self) -> int:
        """Sequences not running: queued, preempted, or parked on their group's leader."""
        return len(self.requests) - len(self.running)

    # ---- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int, int]] = []  # (request, tokens it computes, steps it runs)
        preempted = False
        kv = self.kv
        max_model_len = self.max_model_len
        # 0: not all plain decodes, or a waiting request has a seat to take (a window holds none: no followers)
        window = self.windows.size(self.running, bool(self.waiting) and len(self.running) < self.max_num_seqs)
        i = 0
        # Runs for every running request every step: locals, and no calls where an expression does.
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            pending = request.num_placeholders
            known = len(request.token_ids) + pending  # its tokens once the steps in flight come back
            num_new = min(known - request.num_computed_tokens, budget)
            if num_new <= 0 or (
                pending
                and (known - len(request.prompt_token_ids) >= request.sampling.max_tokens or known >= max_model_len)
            ):
                i += 1  # the step in flight samples its last token (its length limit): nothing more to run
                continue
            start = request.num_computed_tokens
            steps = 1
            if window > 1:
                steps = self.windows.steps_of(request, window, known, max_model_len, kv, len(self.running) - i - 1)
                if not steps:  # short of blocks ahead: the whole step runs single
                    window = steps = 1
                    scheduled = [(r, n, 1) for r, n, _ in scheduled]
            while not kv.allocate(request, start + num_new, write_from=start):
                victim = self.running.pop()
                self._preempt(victim, swap=self.preemption_mode == "swap")
                preempted = True  # nothing is admitted this step, so no swap-in reuses a block swapped out now
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new, steps))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted; everything after it already was

        continuing = len(scheduled)
        # Parked sequences run once their group forks: they hold seats already.
        seats = sum(1 + len(r.followers) for r in self.running) if self.waiting else 0
        while self.waiting and budget > 0 and not preempted:
            request = self.waiting[0]
            if seats + 1 + len(request.followers) > self.max_num_seqs:
                break
            swapped = request.swapped_blocks
            hits = [] if swapped else kv.cached_prefix(request)  # a waiting request holds no device blocks
            start = request.num_computed_tokens if swapped else len(hits) * kv.block_size
            remaining = len(request.token_ids) - start
            num_new = min(remaining, budget)
            if num_new < remaining and not self.enable_chunked_prefill:
                break
            if kv.blocks_for(start + num_new) - len(hits) + kv.num_needed(hits) > kv.num_free_blocks:
                break
            if swapped:
                allocated = kv.allocate(request, start + num_new)
                self.host.swap_in(request, kv)
            else:
                kv.adopt(request, hits)
                allocated = kv.allocate(request, start + num_new)
            assert allocated, "the blocks were counted free"
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            seats += 1 + len(request.followers)
            scheduled.append((request, num_new, 1))
            budget -= num_new

        step_id = next(self._step_ids)
        ran: dict[str, tuple[Request, int]] = {}
        described: list[ScheduledRequest] = []
        advanced: list[tuple[Request, int, int, int]] = []  # what revoke() would put back
        registered: list[int] = []
        caching = kv.enable_prefix_caching
        forked = False
        most_steps = 1
        # One pass over the step's requests (it runs for every request every step). A fork starts only the leader's
        # parked sequences, none of the step's other requests, so each request's turn sees what it would alone.
        for request, num_new, steps in scheduled:
            ran[request.req_id] = (request, request.num_preemptions)
            computed, num_registered = request.num_computed_tokens, request.num_registered_blocks
            scheduled_request = describe(request, num_new, steps)
            described.append(scheduled_request)
            advanced.append((request, computed, steps if scheduled_request.sampling is not None else 0, num_registered))
            if steps > most_steps:
                most_steps = steps
            if caching:
                registered += kv.register(request)
            if request.followers and request.num_computed_tokens >= request.num_shared_tokens:
                self._fork(request)
                forked = True
        if ran:
            self._scheduled[step_id] = ran
        swap_in, swap_out = self.host.take_swaps()
        out = SchedulerOutput(
            step_id=step_id,
            requests=described,
            blocks_to_swap_in=swap_in,
            blocks_to_swap_out=swap_out,
            blocks_to_copy=kv.take_copies(),
            num_steps=most_steps,
        )
        if window and len(scheduled) == len(self.running):  # all decodes, whatever the budget left of the window
            self.windows.sent(step_id, most_steps)
        # Revocable: a step that only moves running requests on. Admissions, forks, preemptions, swaps and
        # copies change more than the requests' own counters (and copies and swaps must reach the cache).
        simple = continuing == len(scheduled) and not (preempted or forked or swap_in or swap_out)
        self._revocable = None
        if scheduled and simple and not out.blocks_to_copy:
            self._revocable = _Revocable(step_id, advanced, registered)
        return out

    def revocable(self, step_id: int) -> bool:
        """Whether ``revoke(step_id)`` can undo that step: it is the newest, and it only moved running
        requests on (no admission, fork, preemption, swap or copy)."""
        return self._revocable is not None and self._revocable.step_id == step_id

    def revoke(self, step_id: int) -> None:
        """Undoes the scheduling of step ``step_id``, which never ran (its submission was withdrawn): its
        requests are back where they were, to be scheduled again, and the blocks it entered in the prefix
        cache (whose KV it would have computed) are out. Blocks it allocated stay with their requests.
        Outputs of older steps applied meanwhile are kept: only the step's own changes are undone."""
        record = self._revocable
        if record is None or record.step_id != step_id:
            raise ValueError(f"step {step_id} cannot be revoked (not the newest, or it changed more than its requests)")
        self._revocable = None
        self._scheduled.pop(step_id, None)
        self.windows.forget(step_id)
        self.kv.unregister(record.registered)
        for request, computed, sampled, registered in record.advanced:
            if request.status != RequestStatus.RUNNING or self.requests.get(request.req_id) is not request:
                continue  # ended meanwhile (aborted, or finished by an older step's output)
            request.num_computed_tokens = computed
            request.num_placeholders -= sampled
            request.num_registered_blocks = registered
        self.num_revoked += 1

    def _fork(self, leader: Request) -> None:
        """The leader's step computes the group's shared prefix: its parked sequences start from there,
        holding the prefix's blocks, and run from the next step on."""
        shared = leader.num_shared_tokens
        for follower in leader.followers:
            follower.leader = None
            self.kv.share(leader, follower, shared)
            follower.num_computed_tokens = shared
            follower.status = RequestStatus.RUNNING
            self.running.append(follower)
        leader.followers = []

    def update_from_output(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Appends the sampled tokens (in place of their placeholders) and applies stop conditions."""
        updates: list[RequestUpdate] = []
        ran = {
            req_id: request
            for req_id, (request, preemptions) in self._scheduled.pop(sched.step_id, {}).items()
            if request.num_preemptions == preemptions and self.requests.get(req_id) is request
        }
        for req_id, rows in (output.prompt_logprobs or {}).items():
            request = ran.get(req_id)
            if request is not None:
                for i, token_ids in enumerate(rows.token_ids):  # a recomputed position keeps its first row
                    request.prompt_logprobs.setdefault(rows.first_pos + i, (token_ids, rows.logprobs[i], rows.ranks[i]))
        self.windows.ran(sched.step_id, output.forward_seconds)
        logprobs = output.logprobs
        running = RequestStatus.RUNNING
        # Runs for every row of every step: locals, and the status compared by identity.
        for req_id, token in zip(output.req_ids, output.sampled_token_ids, strict=True):
            request = ran.get(req_id)
            if request is None or request.status is not running or not request.num_placeholders:
                continue  # aborted, finished or preempted while the step ran: the token is dropped
            request.num_placeholders -= 1
            request.token_ids.append(token)
            status = self._check_stop(request, token)
            if status is not None:
                self.running.remove(request)
                request.status = status
                self._release(request)
            if updates and updates[-1].request is request:  # a window's next token of the sequence
                updates[-1].new_token_ids.append(token)
                updates[-1].finished = status is not None
                continue
            updates.append(
                RequestUpdate(request, [token], status is not None, None if logprobs is None else logprobs.get(req_id))
            )
        return updates

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """Whether ``token``, just appended, ends the request (a stop id or EOS past ``min_tokens``, or a length
        limit). Runs for every row of every step: each length taken once."""
        params = request.sampling
        length = len(request.token_ids)
        n = length - len(request.prompt_token_ids)  # output tokens
        if n >= params.min_tokens:
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if n >= params.max_tokens or length >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def preempt_all(self) -> int:
        """Preempts every running request by recompute (a control call is about to change or free the KV);
        returns how many."""
        count = len(self.running)
        while self.running:
            self._preempt(self.running.pop())  # newest first, so the oldest ends up at the front
        return count

    def drop_swapped(self) -> int:
        """Swapped-out requests recompute instead (their host copy is stale: new weights, or the cache was
        freed); returns how many."""
        dropped = 0
        for request in self.waiting:
            if request.swapped_blocks:
                self.host.release(request)
                request.num_computed_tokens = 0
                dropped += 1
        return dropped

    # ---- internals ---------------------------------------------------------------------------------
    def _preempt(self, request: Request, swap: bool = False) -> None:
        if swap and self.host.swap_out(request, self.kv):
            self.num_swapped_out += 1
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
        request.num_placeholders = 0  # tokens of steps in flight are dropped; the resume samples them again
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        self.host.release(request)
        del self.requests[request.req_id]
        if request.followers:  # ended before its group forked (aborted): the next sequence leads
            leader, *rest = request.followers
            leader.leader = None
            leader.followers = rest
            for follower in rest:
                follower.leader = leader
            request.followers = []
            self.waiting.appendleft(leader)
