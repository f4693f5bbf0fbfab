"""Decode windows: several decode steps run as one engine step while every running sequence decodes plain greedy.

The scheduler's side is driven with a fake model (no torch) that answers ``FIRST_TOKEN + output_index`` for each
step of a window, so outputs come out right only if each row's steps, placeholders and output indices are right.
The worker's side (``run_window``) is driven with a fake step; the engine's, against single steps on a real forward.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aioengine.messages import PLACEHOLDER_TOKEN_ID, LogprobRows, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from aioengine.sampling.params import SamplingParams
from aioengine.scheduler.request import RequestStatus
from aioengine.scheduler.scheduler import Scheduler
from aioengine.worker.step_window import run_window
from tests.conftest import engine_config
from tests.test_async_scheduling import drive_pipelined
from tests.test_scheduler import EOS, FIRST_TOKEN, assert_all_blocks_free, expected_outputs, make_request
from tests.test_step_wire import Wire

TokenFn = Callable[[ScheduledRequest, int], int]
"""The fake model's token for a row at step ``i`` of its window."""


def counting(r: ScheduledRequest, i: int) -> int:
    return FIRST_TOKEN + r.output_index + i


def window_output(sched: SchedulerOutput, token: TokenFn = counting, seconds: float = 0.0) -> ModelRunnerOutput:
    """What the worker answers for ``sched``: each sampling row's tokens together, one per step of its window."""
    req_ids, tokens = [], []
    for r in sched.requests:
        if r.sample:
            for i in range(r.num_steps):
                req_ids.append(r.req_id)
                tokens.append(token(r, i))
    return ModelRunnerOutput(sched.step_id, req_ids, tokens, seconds)


def make_scheduler(
    decode_steps: int = 4, budget_s: float = 1.0, max_model_len: int = 512, measured: bool = True, **limits: int
) -> Scheduler:
    """``measured``: as if an all-decode step had been timed, at no time at all (the fake model's), so windows are
    as long as ``decode_steps`` from the first all-decode step on."""
    sizes = {"num_cache_blocks": 64, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 32}
    s = Scheduler(
        **{**sizes, **limits},
        max_model_len=max_model_len,
        eos_token_ids=[EOS],
        decode_steps=decode_steps,
        decode_window_s=budget_s,
    )
    if measured:
        s.windows.seconds_per_step = 0.0
    return s


def drive(s: Scheduler, token: TokenFn = counting) -> list[SchedulerOutput]:
    """As EngineCore does with async scheduling (``drive_pipelined``); returns every step scheduled, checking that a
    row's blocks cover every position its window computes (a step's block lists are never changed afterwards)."""
    history = drive_pipelined(s, output=lambda done: window_output(done, token))
    for sched in history:
        assert sched.num_steps == max(r.num_steps for r in sched.requests)
        for r in sched.requests:
            assert len(r.block_ids) * s.kv.block_size >= r.start_pos + len(r.token_ids) + r.num_steps - 1
    return history


# ---- the scheduler ---------------------------------------------------------------------------------------------
def test_plain_greedy_decodes_run_as_windows_and_give_every_token_once() -> None:
    s = make_scheduler()
    requests = [make_request(f"r{i}", 3 + 5 * i, max_tokens=3 + 4 * i) for i in range(6)]
    for r in requests:
        s.add_request(r)
    history = drive(s)
    assert all(r.output_token_ids == expected_outputs(r.sampling.max_tokens) for r in requests)
    windows = [h for h in history if h.num_steps > 1]
    assert windows and max(h.num_steps for h in windows) == 4
    # A row runs no more steps than it has tokens left: the one with 3 tokens never runs past them.
    assert any(r.num_steps < h.num_steps for h in windows for r in h.requests)
    assert_all_blocks_free(s)
    single = make_scheduler(decode_steps=1)
    for i in range(6):
        single.add_request(make_request(f"r{i}", 3 + 5 * i, max_tokens=3 + 4 * i))
    assert len(history) < len(drive(single))


def test_no_window_while_a_waiting_request_has_a_seat_and_it_takes_the_first_that_frees() -> None:
    s = make_scheduler(max_num_seqs=2)
    requests = [make_request(f"r{i}", 4, max_tokens=6 + 6 * i) for i in range(3)]
    for r in requests:
        s.add_request(r)
    in_flight: deque[SchedulerOutput] = deque()
    windows_while_seats_full = 0
    while s.has_unfinished_requests() or in_flight:
        seat_free = s.num_waiting > 0 and s.num_running < s.max_num_seqs
        full = s.num_waiting > 0 and not seat_free
        waiting = s.num_waiting
        sched = s.schedule()
        if seat_free:  # admitted now, not after a window
            assert sched.num_steps == 1 and s.num_waiting < waiting
        windows_while_seats_full += full and sched.num_steps > 1
        if not sched.is_empty:
            in_flight.append(sched)
        if len(in_flight) > 1 or (sched.is_empty and in_flight):
            done = in_flight.popleft()
            s.update_from_output(done, window_output(done))
    assert windows_while_seats_full > 0
    assert all(r.output_token_ids == expected_outputs(r.sampling.max_tokens) for r in requests)


@pytest.mark.parametrize(
    "odd",
    [
        {"temperature": 0.7, "seed": 1},
        {"logprobs": 1},
        {"repetition_penalty": 1.2},
        {"prompt_logprobs": 1},
        {"stop": ["x"]},
    ],
    ids=["sampled", "logprobs", "penalty", "prompt logprobs", "stop string"],
)
def test_a_running_row_that_does_more_than_take_its_raw_argmax_keeps_every_step_single(odd: dict) -> None:
    s = make_scheduler()
    plain = [make_request(f"plain{i}", 5, max_tokens=30) for i in range(3)]
    other = make_request("odd", 5, max_tokens=12, **odd)
    if "prompt_logprobs" in odd:  # what the engine's intake sets for such a request
        other.prompt_logprobs_from, other.prompt_logprobs_k = 1, odd["prompt_logprobs"]
    for r in [*plain, other]:
        s.add_request(r)
    history = drive(s)
    assert all(h.num_steps == 1 for h in history if any(r.req_id == "odd" for r in h.requests))
    assert any(h.num_steps > 1 for h in history), "windows once the odd request has ended"
    assert all(r.output_token_ids == expected_outputs(30) for r in plain)


def test_windows_wait_for_min_tokens_to_be_reached() -> None:
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=20, min_tokens=9)
    s.add_request(request)
    history = drive(s)
    for h in history:
        (r,) = h.requests
        assert h.num_steps == 1 or r.output_index >= 9, "a window would sample past min_tokens' ban unchecked"
    assert any(h.num_steps > 1 for h in history)
    assert request.output_token_ids == expected_outputs(20)


def test_a_stop_inside_a_window_ends_the_request_there_and_drops_the_windows_later_tokens() -> None:
    s = make_scheduler()
    stops = make_request("eos", 5, max_tokens=40)  # EOS at its 7th token
    by_id = make_request("stop id", 5, max_tokens=40, stop_token_ids=[FIRST_TOKEN + 9])
    runs = make_request("runs", 5, max_tokens=16)
    for r in (stops, by_id, runs):
        s.add_request(r)

    def token(r: ScheduledRequest, i: int) -> int:
        return EOS if r.req_id == "eos" and r.output_index + i == 6 else counting(r, i)

    history = drive(s, token)
    assert stops.output_token_ids == [*expected_outputs(6), EOS] and stops.status == RequestStatus.FINISHED_STOPPED
    assert by_id.output_token_ids == expected_outputs(10) and by_id.stop_reason == FIRST_TOKEN + 9
    assert runs.output_token_ids == expected_outputs(16)
    assert any(h.num_steps > 1 and any(r.req_id == "eos" for r in h.requests) for h in history)
    assert_all_blocks_free(s)


def test_one_update_per_sequence_and_window_with_its_tokens_in_order() -> None:
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=10)
    s.add_request(request)
    prefill = s.schedule()
    s.update_from_output(prefill, window_output(prefill))
    window = s.schedule()
    assert window.num_steps == 4 and window.requests[0].token_ids == [FIRST_TOKEN]
    (update,) = s.update_from_output(window, window_output(window))
    assert update.request is request and update.new_token_ids == [FIRST_TOKEN + i for i in range(1, 5)]
    assert not update.finished and request.num_placeholders == 0


def test_a_row_near_max_model_len_runs_only_the_steps_it_has_room_for() -> None:
    s = make_scheduler(max_model_len=16)
    request = make_request("r", 5, max_tokens=100)
    s.add_request(request)
    history = drive(s)
    assert request.status == RequestStatus.FINISHED_LENGTH and len(request.token_ids) == 16
    assert all(r.start_pos + r.num_steps <= 16 for h in history for r in h.requests)
    assert any(h.num_steps > 1 for h in history)


def test_a_windows_blocks_ahead_never_leave_a_later_request_short() -> None:
    # 5 usable blocks of 4 tokens. After the prompts (2 blocks each) one is free. At the first decode step "b" needs
    # it for position 8; "a" would need it only for a window (positions 6-9). One step at a time nobody is preempted:
    # the window must not be what preempts "b".
    s = make_scheduler(num_cache_blocks=6)
    a = make_request("a", 6, max_tokens=6)
    b = make_request("b", 8, max_tokens=2)
    for r in (a, b):
        s.add_request(r)
    history = drive(s)
    assert s.num_preemptions == 0
    assert a.output_token_ids == expected_outputs(6) and b.output_token_ids == expected_outputs(2)
    assert history[1].num_steps == 1 and any(h.num_steps > 1 for h in history), "a's window once b is gone"


def test_windows_are_sized_by_the_last_all_decode_steps_time() -> None:
    s = make_scheduler(budget_s=0.02, measured=False)
    s.add_request(make_request("r", 5, max_tokens=200))
    prefill = s.schedule()
    s.update_from_output(prefill, window_output(prefill, seconds=5.0))  # a prefill's time sizes nothing
    sizes = []
    for seconds_per_step in (0.01, 0.03, 0.004, 0.004):
        sched = s.schedule()
        sizes.append(sched.num_steps)
        s.update_from_output(sched, window_output(sched, seconds=seconds_per_step * sched.num_steps))
    # Unmeasured: one step. 0.01 s a step: 2 fit in 0.02. 0.03: 1, still timed, so 0.004 brings back the most.
    assert sizes == [1, 2, 1, 4]
    assert s.windows.seconds_per_step == pytest.approx(0.004)


def test_revoking_a_queued_window_puts_its_requests_back_as_they_were() -> None:
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=30)
    s.add_request(request)
    s.update_from_output(prefill := s.schedule(), window_output(prefill))
    in_flight = s.schedule()
    queued = s.schedule()
    assert queued.num_steps == 4 and s.revocable(queued.step_id)
    state = (request.num_computed_tokens, request.num_placeholders)
    s.revoke(queued.step_id)
    assert (request.num_computed_tokens, request.num_placeholders) == (state[0] - 4, state[1] - 4)
    again = s.schedule()
    assert [(r.start_pos, r.num_steps, r.output_index) for r in again.requests] == [
        (r.start_pos, r.num_steps, r.output_index) for r in queued.requests
    ]
    for done in (in_flight, again):
        s.update_from_output(done, window_output(done))
    drive(s)
    assert request.output_token_ids == expected_outputs(30)


def test_a_window_goes_over_the_process_wire_as_it_was_scheduled() -> None:
    s = make_scheduler()
    for i in range(3):
        s.add_request(make_request(f"r{i}", 6, max_tokens=9))
    wire = Wire()
    in_flight: deque[SchedulerOutput] = deque()
    sent_windows = 0
    while s.has_unfinished_requests() or in_flight:
        sched = s.schedule()
        if not sched.is_empty:
            decoded, _, _ = wire.send(sched)
            assert decoded == sched
            sent_windows += sched.num_steps > 1
            in_flight.append(sched)
        if len(in_flight) > 1 or (sched.is_empty and in_flight):
            done = in_flight.popleft()
            s.update_from_output(done, window_output(done))
    assert sent_windows


# ---- the worker ---------------------------------------------------------------------------------------------
def test_each_step_of_a_window_is_the_one_before_moved_on_and_the_answer_goes_row_by_row() -> None:
    greedy = SamplingParams(temperature=0.0)
    rows = [
        ScheduledRequest("a", [PLACEHOLDER_TOKEN_ID], 10, [1, 2, 3], greedy, 4, num_steps=3),
        ScheduledRequest("b", [7], 20, [4, 5], greedy, 9, num_steps=1),
        ScheduledRequest("c", [PLACEHOLDER_TOKEN_ID], 30, [6, 7], greedy, 2, num_steps=2),
    ]
    seen: list[SchedulerOutput] = []

    def run_step(step: SchedulerOutput) -> ModelRunnerOutput:
        seen.append(step)
        rows = step.requests
        return ModelRunnerOutput(step.step_id, [r.req_id for r in rows], [r.start_pos for r in rows], 0.5)

    out = run_window(SchedulerOutput(7, rows, num_steps=3), run_step)
    assert [[(r.req_id, r.start_pos, r.output_index) for r in step.requests] for step in seen] == [
        [("a", 10, 4), ("b", 20, 9), ("c", 30, 2)],
        [("a", 11, 5), ("c", 31, 3)],
        [("a", 12, 6)],
    ]
    assert all(r.token_ids == [PLACEHOLDER_TOKEN_ID] for step in seen[1:] for r in step.requests)
    assert all(step.step_id == 7 for step in seen) and all(step.num_steps == 1 for step in seen[1:])
    assert all(r.block_ids is rows[0].block_ids for step in seen[1:] for r in step.requests if r.req_id == "a")
    assert (out.step_id, out.req_ids, out.sampled_token_ids) == (7, list("aaabcc"), [10, 11, 12, 20, 30, 31])
    assert out.forward_seconds == pytest.approx(1.5)


def test_a_windows_next_step_keeps_every_field_it_does_not_move_on() -> None:
    from aioengine.messages import PromptLogprobsSpec
    from aioengine.worker.step_window import _next

    # Every field set off its default, so a field _next forgets shows as a difference.
    r = ScheduledRequest(
        "r", [5], 9, [4, 5], SamplingParams(temperature=0.0), 3, 1, [7, 8], 2, PromptLogprobsSpec(1, 10, [2]), 4
    )
    assert {f.name for f in dataclasses.fields(r)} == {
        f.name for f in dataclasses.fields(r) if getattr(r, f.name) != f.default
    }
    moved = dataclasses.replace(
        r, token_ids=[PLACEHOLDER_TOKEN_ID], start_pos=10, output_index=4, history=None, prompt_logprobs=None
    )
    assert _next(r) == moved


def test_a_window_step_answering_logprobs_is_refused() -> None:
    greedy = SamplingParams(temperature=0.0)
    rows = [ScheduledRequest("a", [5], 10, [1, 2], greedy, 4, num_steps=2)]

    def run_step(step: SchedulerOutput) -> ModelRunnerOutput:
        return ModelRunnerOutput(step.step_id, ["a"], [1], logprobs={"a": LogprobRows(11, [[1]], [[0.0]], [[1]])})

    with pytest.raises(RuntimeError, match="no logprobs"):
        run_window(SchedulerOutput(0, rows, num_steps=2), run_step)


# ---- the engine ---------------------------------------------------------------------------------------------
async def generate_all(
    path: Path, decode_steps: int, requests: list[tuple[list[int], SamplingParams]], **sections: Any
) -> tuple:
    """Each request's tokens and finish reason, and the engine's step count, with windows of up to ``decode_steps``
    (``sections``: more of the config)."""
    from aioengine import AsyncEngine

    config = engine_config(path, scheduler={"decode_steps": decode_steps, "decode_window_s": 10.0}, **sections)
    async with AsyncEngine(config) as engine:

        async def one(prompt: list[int], params: SamplingParams) -> tuple[list[int], str | None]:
            last = None
            async for out in engine.generate(prompt, params):
                last = out
            assert last is not None
            return list(last.token_ids), last.outputs[0].finish_reason

        results = await asyncio.gather(*(one(p, params) for p, params in requests))
        return results, engine.core.num_steps


async def test_windows_give_the_tokens_single_steps_give(llama_ckpt: Path) -> None:
    """Greedy requests of many lengths, some ending on EOS or a stop id, on the real forward: windows of 4 steps give
    every token and finish reason one step at a time gives, in fewer engine steps."""
    prompts = [[(7 * i + 3 * j) % 200 + 3 for j in range(5 + 9 * i % 40)] for i in range(10)]
    plain = [
        (p, SamplingParams(temperature=0.0, max_tokens=5 + 7 * i, ignore_eos=i % 2 == 0)) for i, p in enumerate(prompts)
    ]
    single, single_steps = await generate_all(llama_ckpt, 1, plain)
    # A stop id taken from a request's own single-step output: the request must end there, inside a window.
    stop = single[3][0][6]
    plain[3] = (prompts[3], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop]))
    single, single_steps = await generate_all(llama_ckpt, 1, plain)
    windowed, windowed_steps = await generate_all(llama_ckpt, 4, plain)
    assert windowed == single
    assert single[3][1] == "stop" and len(single[3][0]) <= 7
    assert windowed_steps < single_steps


async def test_a_request_with_a_seat_takes_back_the_window_queued_behind_the_running_step(llama_ckpt: Path) -> None:
    """A new request would wait for the window running and the one queued behind it. The queued one (no worker has
    started it: each forward here sleeps first) is taken back and scheduled again with the new request."""
    from aioengine import AsyncEngine
    from tests.helpers import final, wait_until
    from tests.test_concurrency import slow_forward

    config = engine_config(llama_ckpt, scheduler={"decode_steps": 4, "decode_window_s": 10.0})
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        alone = (await final(engine, [9, 8, 7], short)).token_ids
        await engine.collective_rpc(slow_forward, args=(0.05,))  # a window runs 0.2 s: the new request comes first
        core = engine.core
        running = asyncio.create_task(final(engine, [5, 6, 7], long))
        await wait_until(lambda: len(core._inflight) > 1 and core._inflight[-1][0].num_steps > 1, "a window queued")
        revoked = core.scheduler.num_revoked
        joined = await final(engine, [9, 8, 7], short)
        assert core.scheduler.num_revoked == revoked + 1
        assert joined.token_ids == alone
        assert len((await running).token_ids) == 30
