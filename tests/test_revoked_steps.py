"""A control call takes back the step queued behind the running one (``EngineCore.revoke_queued_step``):
which steps the Scheduler can revoke and what revoking undoes (fake model, no torch), the thread executor's
withdrawal of a step no worker took, and streams that come out of many pauses as an uninterrupted run."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from pathlib import Path

import pytest

from aioengine import AsyncEngine
from aioengine.messages import SchedulerOutput
from aioengine.scheduler.request import Request, RequestStatus
from aioengine.scheduler.scheduler import Scheduler
from tests.engine_request_support import greedy
from tests.helpers import TIMEOUT, wait_until
from tests.sleep_support import token_ids
from tests.test_async_scheduling import drive_pipelined, fake_output
from tests.test_pause import PROMPTS, Streams
from tests.test_scheduler import EOS, expected_outputs, make_request, make_scheduler


def counters(requests: list[Request]) -> list[tuple[int, int, int]]:
    return [(r.num_computed_tokens, r.num_placeholders, r.num_registered_blocks) for r in requests]


def described(sched: SchedulerOutput) -> list[tuple[str, list[int], int, int, bool]]:
    return [(r.req_id, r.token_ids, r.start_pos, r.output_index, r.sample) for r in sched.requests]


def prefix_scheduler(max_num_batched_tokens: int = 32) -> Scheduler:
    return Scheduler(
        num_cache_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=512,
        eos_token_ids=[EOS],
        enable_prefix_caching=True,
    )


# ---- the scheduler -----------------------------------------------------------------------------------------
def test_a_revoked_decode_step_leaves_its_requests_as_they_were_and_is_scheduled_again_the_same() -> None:
    s = make_scheduler()
    requests = [make_request(f"r{i}", 5 + i, max_tokens=6) for i in range(3)]
    for r in requests:
        s.add_request(r)
    prefill = s.schedule()
    before = counters(requests)
    queued = s.schedule()  # decodes the tokens the prefill samples: placeholders only
    assert s.revocable(queued.step_id) and not s.revocable(prefill.step_id)
    s.revoke(queued.step_id)
    assert counters(requests) == before and s.num_revoked == 1
    s.update_from_output(prefill, fake_output(prefill))
    again = s.schedule()
    # The same requests at the same positions; the placeholders are now the tokens the prefill sampled.
    assert [(i, p, o, x) for i, _, p, o, x in described(again)] == [(i, p, o, x) for i, _, p, o, x in described(queued)]
    assert [t for _, t, *_ in described(again)] == [[r.token_ids[-1]] for r in requests]
    drive_pipelined(s, scheduled=[again])
    assert all(r.output_token_ids == expected_outputs(6) for r in requests)
    s.kv.check([])
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def test_revoking_a_prefill_chunk_takes_the_blocks_it_entered_out_of_the_prefix_cache() -> None:
    s = prefix_scheduler(max_num_batched_tokens=8)
    request = make_request("long", 20, max_tokens=3)
    s.add_request(request)
    first = s.schedule()  # tokens 0-7, admitted
    cached_after_first = dict(s.kv.cached)
    second = s.schedule()  # tokens 8-15 of a running request: registers the blocks it computes
    assert len(s.kv.cached) > len(cached_after_first)
    assert s.revocable(second.step_id)
    s.revoke(second.step_id)
    assert s.kv.cached == cached_after_first, "a block whose KV was never computed stayed in the prefix cache"
    assert request.num_computed_tokens == 8
    s.kv.check([request])
    s.update_from_output(first, fake_output(first))
    again = s.schedule()
    assert described(again) == described(second)
    assert len(s.kv.cached) > len(cached_after_first)
    drive_pipelined(s, scheduled=[again])
    assert request.output_token_ids == expected_outputs(3)
    # A request with the same prompt finds the whole prefix cached, as without the revoke.
    twin = make_request("twin", 20, max_tokens=1)
    assert len(s.kv.cached_prefix(twin)) == 4


def test_only_the_newest_step_that_just_moves_running_requests_on_can_be_revoked() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=8))
    admitting = s.schedule()
    assert not s.revocable(admitting.step_id), "a step that admits requests changes the queues"
    s.add_request(make_request("b", 5, max_tokens=8))
    mixed = s.schedule()  # a's decode and b's admission
    assert not s.revocable(mixed.step_id)
    decode = s.schedule()
    assert s.revocable(decode.step_id)
    newer = s.schedule()
    assert not s.revocable(decode.step_id), "only the newest step can be revoked"
    with pytest.raises(ValueError, match=f"step {decode.step_id} cannot be revoked"):
        s.revoke(decode.step_id)
    assert s.revocable(newer.step_id)


def test_a_step_that_forks_a_group_cannot_be_revoked() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    leader = make_request("g", 12, max_tokens=3)
    leader.followers = [make_request("g.1", 12, max_tokens=3)]
    leader.num_shared_tokens = 12
    s.add_request(leader)
    s.schedule()  # the first 8 prompt tokens
    forking = s.schedule()  # the last 4: the shared prefix is covered, the follower starts
    assert s.num_running == 2
    assert not s.revocable(forking.step_id)


def test_a_step_that_preempts_cannot_be_revoked() -> None:
    s = make_scheduler(num_cache_blocks=5, block_size=4, max_num_batched_tokens=64)
    a, b = make_request("a", 7, max_tokens=20), make_request("b", 7, max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    in_flight = deque([s.schedule()])
    preempting = None
    for _ in range(20):
        sched = s.schedule()
        if s.num_preemptions:
            preempting = sched
            break
        in_flight.append(sched)
        done = in_flight.popleft()
        s.update_from_output(done, fake_output(done))
    assert preempting is not None, "the cache never ran out"
    assert not s.revocable(preempting.step_id)


def test_a_request_aborted_between_the_schedule_and_the_revoke_stays_ended() -> None:
    s = make_scheduler()
    requests = [make_request(f"r{i}", 6, max_tokens=5) for i in range(3)]
    for r in requests:
        s.add_request(r)
    prefill = s.schedule()
    before = counters(requests)
    queued = s.schedule()
    s.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    s.revoke(queued.step_id)
    assert counters([requests[0], requests[2]]) == [before[0], before[2]]
    assert requests[1].status == RequestStatus.FINISHED_ABORTED and requests[1] not in s.running
    s.kv.check(s.running)
    drive_pipelined(s, scheduled=[prefill])
    assert [r.output_token_ids for r in (requests[0], requests[2])] == [expected_outputs(5)] * 2
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


# ---- the thread executor -------------------------------------------------------------------------------------
async def test_the_thread_executor_withdraws_a_step_no_worker_took_and_never_runs_it(
    llama_engine: AsyncEngine,
) -> None:
    engine = llama_engine
    executor, scheduler = engine.core.executor, engine.core.scheduler
    ran: list[bool] = []
    release = threading.Event()

    def hold(worker: object) -> None:
        release.wait(TIMEOUT)

    # Steps are made by hand here, the engine idle: its loop has nothing to schedule meanwhile.
    scheduler.add_request(make_request("held", 6, max_tokens=4))
    blocker = asyncio.ensure_future(executor.collective_rpc(hold))
    future = executor.submit_step(scheduler.schedule())
    assert executor.withdraw_step(future), "a step still queued on the thread is withdrawn"
    release.set()
    await blocker
    # The step would have sampled a token for "held": the runner keeps the last step's (async scheduling).
    await executor.collective_rpc(lambda worker: ran.append("held" in worker.model_runner._last_sampled))
    assert future.cancelled() and ran == [False], "the withdrawn step ran"
    scheduler.finish_requests(["held"], RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(make_request("ran", 6, max_tokens=4))
    done = executor.submit_step(scheduler.schedule())
    await done
    assert not executor.withdraw_step(done), "a step that ran cannot be withdrawn"
    await executor.collective_rpc(lambda worker: ran.append("ran" in worker.model_runner._last_sampled))
    assert ran == [False, True]
    scheduler.finish_requests(["ran"], RequestStatus.FINISHED_ABORTED)


# ---- the engine ----------------------------------------------------------------------------------------------
async def test_streams_paused_many_times_lose_their_queued_steps_and_finish_as_an_uninterrupted_run(
    llama_ckpt: Path, make_engine: object
) -> None:
    params = greedy(60, ignore_eos=True)
    async with make_engine(llama_ckpt) as engine:  # type: ignore[operator]
        uninterrupted = await token_ids(engine, PROMPTS, params)
        streams = Streams(engine, PROMPTS, params)
        await streams.started()
        pauses = 0
        while engine.stats().num_revoked_steps < 3 and min(streams.counts()) < 50:
            seen = sum(streams.counts())
            await engine.pause_generation(mode="keep")
            await engine.resume_generation()
            pauses += 1
            await wait_until(lambda seen=seen: sum(streams.counts()) > seen, "the streams went on after the resume")
        revoked = engine.stats().num_revoked_steps
        outs = await streams.results()
    assert revoked >= 1, f"no queued step was revoked in {pauses} pauses"
    assert [list(o.token_ids) for o in outs] == uninterrupted
    assert all(o.finish_reason == "length" and o.num_preemptions == 0 for o in outs)
