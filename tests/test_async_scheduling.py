"""Specification of async scheduling in the Scheduler: step N+1 is scheduled before step N's outputs
come back, the tokens N samples standing in as placeholders (driven with a fake model, no torch).

The fake model answers ``FIRST_TOKEN + output_index``, so outputs are known in advance however the
steps overlap, and only come out right if placeholders, output indices and dropped tokens are right.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterable

from aioengine.messages import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from aioengine.scheduler.request import RequestStatus
from tests.test_scheduler import (
    FIRST_TOKEN,
    assert_all_blocks_free,
    default_token,
    expected_outputs,
    make_request,
    make_scheduler,
)


def fake_output(sched: SchedulerOutput) -> ModelRunnerOutput:
    sampling = [r for r in sched.requests if r.sample]
    return ModelRunnerOutput(sched.step_id, [r.req_id for r in sampling], [default_token(r) for r in sampling])


def drive_pipelined(
    s,
    max_steps: int = 1000,
    scheduled: Iterable[SchedulerOutput] = (),
    output: Callable[[SchedulerOutput], ModelRunnerOutput] = fake_output,
) -> list[SchedulerOutput]:
    """As EngineCore does with async scheduling: one step stays queued behind the one whose outputs
    are applied next; returns every step scheduled (after ``scheduled``, steps already in flight).
    ``output``: the fake model's answer to a step."""
    in_flight: deque[SchedulerOutput] = deque(scheduled)
    history = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests() and not in_flight:
            return history
        sched = s.schedule()
        if not sched.is_empty:
            in_flight.append(sched)
            history.append(sched)
        if len(in_flight) > 1 or (sched.is_empty and in_flight):
            done = in_flight.popleft()
            s.update_from_output(done, output(done))
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(s.requests)}")


def test_the_next_step_computes_a_placeholder_for_the_token_in_flight():
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=4)
    s.add_request(request)
    prefill = s.schedule()
    decode = s.schedule()  # before the prefill's output is back
    (scheduled,) = decode.requests
    assert scheduled.token_ids == [PLACEHOLDER_TOKEN_ID]
    assert (scheduled.start_pos, scheduled.output_index) == (5, 1)
    assert scheduled.sample and len(scheduled.block_ids) * 4 >= 6
    s.update_from_output(prefill, fake_output(prefill))
    s.update_from_output(decode, fake_output(decode))
    assert request.output_token_ids == [FIRST_TOKEN, FIRST_TOKEN + 1]
    assert request.num_placeholders == 0


def test_a_request_whose_step_in_flight_reaches_max_tokens_is_not_scheduled_again():
    s = make_scheduler()
    request = make_request("r", 5, max_tokens=1)
    s.add_request(request)
    prefill = s.schedule()
    assert s.schedule().is_empty, "its last token is in flight: nothing more to compute"
    s.update_from_output(prefill, fake_output(prefill))
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(s)


def test_pipelined_steps_give_the_outputs_of_one_step_at_a_time():
    s = make_scheduler(num_cache_blocks=24, max_num_batched_tokens=16)  # small: chunking and preemption both happen
    requests = [make_request(f"r{i}", 3 + 7 * i % 30, max_tokens=4 + i % 5) for i in range(10)]
    for r in requests:
        s.add_request(r)
    history = drive_pipelined(s)
    assert all(r.output_token_ids == expected_outputs(r.sampling.max_tokens) for r in requests)
    assert any(PLACEHOLDER_TOKEN_ID in r.token_ids for h in history for r in h.requests)
    assert s.num_preemptions > 0
    assert_all_blocks_free(s)


def test_a_preempted_request_drops_the_token_of_its_step_in_flight_and_recomputes_it():
    s = make_scheduler(num_cache_blocks=3, block_size=4, max_num_batched_tokens=16)  # 2 usable blocks
    old = make_request("old", 4, max_tokens=3)
    young = make_request("young", 3, max_tokens=3)
    s.add_request(old)
    s.add_request(young)
    first = s.schedule()  # both prefills, one block each
    second = s.schedule()  # both need a second block; only one is free: the youngest is preempted
    assert [r.req_id for r in second.requests] == ["old"]
    assert young.status == RequestStatus.WAITING and young.num_placeholders == 0
    s.update_from_output(first, fake_output(first))
    assert young.output_token_ids == [], "the preempted request's in-flight token is dropped"
    s.update_from_output(second, fake_output(second))
    drive_pipelined(s)
    assert old.output_token_ids == young.output_token_ids == expected_outputs(3)


def test_an_output_in_flight_never_reaches_a_new_request_under_the_same_id():
    s = make_scheduler()
    gone = make_request("same", 5, max_tokens=10)
    s.add_request(gone)
    s.update_from_output(prefill := s.schedule(), fake_output(prefill))
    in_flight = s.schedule()  # gone's decode
    s.finish_requests(["same"], RequestStatus.FINISHED_ABORTED)
    again = make_request("same", 5, max_tokens=10)
    s.add_request(again)
    new_prefill = s.schedule()  # again is RUNNING, with a token in flight, before gone's step is back
    s.update_from_output(in_flight, fake_output(in_flight))
    assert again.output_token_ids == [] and again.num_placeholders == 1
    s.update_from_output(new_prefill, fake_output(new_prefill))
    assert again.output_token_ids == [FIRST_TOKEN]


def test_a_scheduled_step_stays_as_it_was_sent_while_later_steps_grow_the_request():
    # Workers (and the benchmark's replay) may hold a step after the scheduler moved on.
    s = make_scheduler(block_size=4)
    s.add_request(make_request("r", 3, max_tokens=9))
    first = s.schedule()
    sent = copy.deepcopy(first)
    s.update_from_output(first, fake_output(first))
    drive_pipelined(s)  # the block table grows three times, tokens are appended
    assert first == sent
