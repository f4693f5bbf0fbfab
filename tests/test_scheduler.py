"""Specification of the Scheduler, driven with fake ModelRunnerOutputs (no model, no torch).

The fake model answers every sampling row with ``FIRST_TOKEN + output_index``, so a request's
outputs are known in advance whatever the batching, and survive preemption only if the
scheduler recomputes with the right output index.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from aioengine.messages import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from aioengine.sampling.params import SamplingParams
from aioengine.scheduler.request import Request, RequestStatus
from aioengine.scheduler.scheduler import RequestUpdate, Scheduler

EOS = 2
FIRST_TOKEN = 100  # well away from EOS, so the fake model never stops a request by accident

TokenFn = Callable[[ScheduledRequest], int]


def default_token(req: ScheduledRequest) -> int:
    return FIRST_TOKEN + req.output_index


def make_scheduler(
    num_cache_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 512,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    return Scheduler(
        num_cache_blocks=num_cache_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=[EOS],
        enable_chunked_prefill=enable_chunked_prefill,
    )


def make_request(req_id: str, prompt_len: int, **params: object) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(req_id, [10 + i % 50 for i in range(prompt_len)], SamplingParams(**params))  # type: ignore[arg-type]


def step(s: Scheduler, token: TokenFn = default_token) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    """One schedule -> fake forward -> update, checking the invariants every step must keep."""
    sched = s.schedule()
    assert sched.num_tokens <= s.max_num_batched_tokens
    assert len(sched.requests) <= s.max_num_seqs
    assert len(s.running) <= s.max_num_seqs
    seen_blocks: set[int] = set()
    for r in sched.requests:
        assert r.token_ids, "a scheduled request computes at least one token"
        assert len(r.block_ids) * s.kv.block_size >= r.start_pos + len(r.token_ids)
        assert seen_blocks.isdisjoint(r.block_ids), "two requests share a KV block"
        seen_blocks.update(r.block_ids)
    sampling = [r for r in sched.requests if r.sample]
    out = ModelRunnerOutput(sched.step_id, [r.req_id for r in sampling], [token(r) for r in sampling])
    return sched, s.update_from_output(sched, out)


def drive(s: Scheduler, token: TokenFn = default_token, max_steps: int = 1000) -> list[SchedulerOutput]:
    """Steps until every request finished; returns what each step scheduled."""
    history = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return history
        sched, _ = step(s, token)
        history.append(sched)
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(s.requests)}")


def assert_all_blocks_free(s: Scheduler) -> None:
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks
    assert s.num_running == 0 and s.num_waiting == 0 and not s.requests


def expected_outputs(n: int) -> list[int]:
    return [FIRST_TOKEN + i for i in range(n)]


# --- budget and batch limits ------------------------------------------------------------------


def test_token_budget_is_respected_every_step_and_used_fully_when_work_allows():
    s = make_scheduler(max_num_batched_tokens=24, max_num_seqs=16)
    requests = [make_request(f"r{i}", 3 + 7 * i % 40, max_tokens=5) for i in range(12)]
    for r in requests:
        s.add_request(r)
    history = drive(s)  # step() asserts num_tokens <= budget on every step
    assert max(h.num_tokens for h in history) == 24, "the budget should bind while prompts queue up"
    assert all(r.output_token_ids == expected_outputs(5) for r in requests)
    assert_all_blocks_free(s)


def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_chunks():
    s = make_scheduler(max_num_batched_tokens=16)
    request = make_request("long", 50, max_tokens=3)
    s.add_request(request)
    chunks = [step(s)[0].requests for _ in range(4)]
    assert [len(c) for c in chunks] == [1, 1, 1, 1]
    assert [c[0].start_pos for c in chunks] == [0, 16, 32, 48]
    assert [len(c[0].token_ids) for c in chunks] == [16, 16, 16, 2]
    assert [t for c in chunks for t in c[0].token_ids] == request.prompt_token_ids


def test_chunked_prefill_samples_only_on_the_last_chunk():
    s = make_scheduler(max_num_batched_tokens=16)
    request = make_request("long", 50, max_tokens=3)
    s.add_request(request)
    samples = []
    for _ in range(4):
        sched, updates = step(s)
        samples.append(sched.requests[0].sample)
        if not samples[-1]:
            assert updates == [] and request.num_output_tokens == 0
    assert samples == [False, False, False, True]
    assert request.output_token_ids == [FIRST_TOKEN]
    assert request.num_computed_tokens == 50


def test_prefill_chunk_shares_the_budget_with_running_decodes():
    s = make_scheduler(max_num_batched_tokens=16)
    short = make_request("short", 4, max_tokens=10)
    s.add_request(short)
    step(s)  # short's prefill
    s.add_request(make_request("long", 40, max_tokens=2))
    sched, _ = step(s)
    sizes = {r.req_id: len(r.token_ids) for r in sched.requests}
    assert sizes == {"short": 1, "long": 15}, "the decode goes first, the prefill takes the rest"


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_for_the_next_step():
    s = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    s.add_request(make_request("a", 10, max_tokens=2))
    s.add_request(make_request("b", 10, max_tokens=2))
    sched, _ = step(s)
    assert [(r.req_id, len(r.token_ids)) for r in sched.requests] == [("a", 10)]
    sched, _ = step(s)
    assert [(r.req_id, len(r.token_ids)) for r in sched.requests] == [("a", 1), ("b", 10)]


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=256)
    requests = [make_request(f"r{i}", 5, max_tokens=4) for i in range(10)]
    for r in requests:
        s.add_request(r)
    first, _ = step(s)
    assert [r.req_id for r in first.requests] == ["r0", "r1", "r2"]
    assert s.num_waiting == 7
    drive(s)  # step() asserts <= max_num_seqs on every step
    assert all(r.output_token_ids == expected_outputs(4) for r in requests)
    assert_all_blocks_free(s)


def test_requests_are_admitted_in_arrival_order():
    s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=256)
    for name in ["c", "a", "b"]:
        s.add_request(make_request(name, 3, max_tokens=1))
    order = [sched.requests[0].req_id for sched in drive(s)]
    assert order == ["c", "a", "b"]


# --- preemption -------------------------------------------------------------------------------


def preemption_setup() -> tuple[Scheduler, Request, Request, Request]:
    """Two running requests that together need 6 blocks of a 4-block cache, and one waiting."""
    s = make_scheduler(num_cache_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = (make_request(name, 4, max_tokens=8) for name in "abc")
    for r in (a, b, c):
        s.add_request(r)
    return s, a, b, c


def run_until_first_preemption(s: Scheduler) -> SchedulerOutput:
    for _ in range(100):
        sched, _ = step(s)
        if s.num_preemptions:
            return sched
    raise AssertionError("no preemption happened")


def test_when_blocks_run_out_the_newest_running_request_is_preempted():
    s, a, b, _ = preemption_setup()
    sched = run_until_first_preemption(s)
    assert [r.req_id for r in sched.requests] == ["a"], "the oldest request keeps going"
    assert a.status == RequestStatus.RUNNING
    assert b.status == RequestStatus.WAITING and b.num_preemptions == 1
    assert b.block_ids == [] and b.num_computed_tokens == 0


def test_a_preempted_request_goes_to_the_front_of_the_waiting_queue():
    s, _, b, c = preemption_setup()
    run_until_first_preemption(s)
    assert list(s.waiting) == [b, c]


def test_a_preempted_request_keeps_its_outputs_and_recomputes_them():
    s, _, b, _ = preemption_setup()
    run_until_first_preemption(s)
    generated = list(b.output_token_ids)
    assert generated, "b had produced tokens before it was preempted"
    for _ in range(100):
        sched, _ = step(s)
        resumed = [r for r in sched.requests if r.req_id == "b"]
        if resumed:
            break
    # The whole known sequence comes back as a prefill, and sampling continues where it stopped.
    assert resumed[0].start_pos == 0
    assert resumed[0].token_ids == b.prompt_token_ids + generated
    assert resumed[0].output_index == len(generated)


def test_preempted_requests_all_complete_and_every_block_returns():
    s, a, b, c = preemption_setup()
    drive(s)
    assert s.num_preemptions >= 1
    for r in (a, b, c):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_outputs(8)
    assert_all_blocks_free(s)


def test_many_requests_on_a_tiny_cache_all_complete():
    s = make_scheduler(num_cache_blocks=10, block_size=4, max_num_seqs=8, max_num_batched_tokens=20)
    requests = [make_request(f"r{i}", 2 + i % 9, max_tokens=3 + i % 6) for i in range(30)]
    for r in requests:
        s.add_request(r)
    drive(s)
    assert s.num_preemptions > 0, "the cache is small enough that preemption must happen"
    for i, r in enumerate(requests):
        assert r.output_token_ids == expected_outputs(3 + i % 6), r.req_id
    assert_all_blocks_free(s)


# --- finishing and freeing --------------------------------------------------------------------


def test_blocks_are_freed_when_a_request_finishes():
    s = make_scheduler(num_cache_blocks=16)
    request = make_request("r", 9, max_tokens=2)
    s.add_request(request)
    step(s)
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks - 3
    _, updates = step(s)
    assert updates[0].finished and request.status == RequestStatus.FINISHED_LENGTH
    assert_all_blocks_free(s)


def test_finish_requests_frees_a_running_request():
    s = make_scheduler(num_cache_blocks=16)
    request = make_request("r", 9, max_tokens=10)
    s.add_request(request)
    step(s)
    done = s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert done == [request]
    assert request.status == RequestStatus.FINISHED_ABORTED and request.finish_reason == "abort"
    assert_all_blocks_free(s)


def test_finish_requests_removes_a_waiting_request():
    s = make_scheduler(max_num_seqs=1)
    first, second = make_request("first", 3, max_tokens=4), make_request("second", 3, max_tokens=4)
    s.add_request(first)
    s.add_request(second)
    step(s)
    assert s.finish_requests(["second"], RequestStatus.FINISHED_ABORTED) == [second]
    assert list(s.waiting) == []
    drive(s)
    assert first.output_token_ids == expected_outputs(4)
    assert_all_blocks_free(s)


def test_finish_requests_ignores_unknown_ids():
    s = make_scheduler()
    assert s.finish_requests(["nope"], RequestStatus.FINISHED_ABORTED) == []


def test_a_token_for_a_request_aborted_during_the_step_is_dropped():
    s = make_scheduler()
    request = make_request("r", 3, max_tokens=4)
    s.add_request(request)
    sched = s.schedule()
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)  # abort lands while the forward runs
    updates = s.update_from_output(sched, ModelRunnerOutput(sched.step_id, ["r"], [FIRST_TOKEN]))
    assert updates == []
    assert request.output_token_ids == []
    assert_all_blocks_free(s)


def test_a_request_id_already_in_flight_is_refused():
    s = make_scheduler()
    s.add_request(make_request("r", 3))
    with pytest.raises(ValueError, match="'r'"):
        s.add_request(make_request("r", 3))


# --- stop conditions --------------------------------------------------------------------------


def eos_at(*indices: int) -> TokenFn:
    return lambda req: EOS if req.output_index in indices else default_token(req)


def test_eos_stops_a_request():
    s = make_scheduler()
    request = make_request("r", 3, max_tokens=10)
    s.add_request(request)
    drive(s, eos_at(2))
    assert request.output_token_ids == [FIRST_TOKEN, FIRST_TOKEN + 1, EOS]
    assert request.finish_reason == "stop"
    assert request.stop_reason is None
    assert_all_blocks_free(s)


def test_ignore_eos_generates_past_eos_until_max_tokens():
    s = make_scheduler()
    request = make_request("r", 3, max_tokens=6, ignore_eos=True)
    s.add_request(request)
    drive(s, eos_at(2))
    assert request.num_output_tokens == 6
    assert request.output_token_ids[2] == EOS
    assert request.finish_reason == "length"


def test_stop_token_id_stops_and_is_reported_as_the_stop_reason():
    s = make_scheduler()
    request = make_request("r", 3, max_tokens=10, stop_token_ids=[FIRST_TOKEN + 3])
    s.add_request(request)
    drive(s)
    assert request.output_token_ids == expected_outputs(4)
    assert request.finish_reason == "stop"
    assert request.stop_reason == FIRST_TOKEN + 3


def test_stop_token_ids_apply_even_with_ignore_eos():
    s = make_scheduler()
    request = make_request("r", 3, max_tokens=10, ignore_eos=True, stop_token_ids=[FIRST_TOKEN + 1])
    s.add_request(request)
    drive(s)
    assert request.output_token_ids == expected_outputs(2)
    assert request.finish_reason == "stop"


def test_min_tokens_ignores_eos_until_that_many_tokens_were_generated():
    s = make_scheduler()
    request = make_request("r", 3, max_tokens=10, min_tokens=4)
    s.add_request(request)
    drive(s, eos_at(1, 3))
    assert request.num_output_tokens == 4, "the EOS at index 1 is ignored, the one at index 3 stops"
    assert request.finish_reason == "stop"


def test_min_tokens_ignores_stop_token_ids_too():
    s = make_scheduler()
    request = make_request("r", 3, max_tokens=10, min_tokens=3, stop_token_ids=[FIRST_TOKEN])
    s.add_request(request)
    drive(s, lambda req: FIRST_TOKEN)
    assert request.num_output_tokens == 3
    assert request.stop_reason == FIRST_TOKEN


def test_max_tokens_finishes_with_reason_length():
    s = make_scheduler()
    request = make_request("r", 3, max_tokens=5)
    s.add_request(request)
    drive(s)
    assert request.output_token_ids == expected_outputs(5)
    assert request.finish_reason == "length"


def test_max_model_len_finishes_a_request_before_max_tokens():
    s = make_scheduler(max_model_len=14)
    request = make_request("r", 10, max_tokens=100)
    s.add_request(request)
    drive(s)
    assert len(request.token_ids) == 14
    assert request.num_output_tokens == 4
    assert request.finish_reason == "length"
    assert_all_blocks_free(s)
