"""Specification of preemption by swapping: a request preempted for want of KV blocks (preemption_mode
"swap") has its computed blocks copied to the host pool and back before the step that resumes it; when
the pool is full it recomputes instead; control calls that change or free the KV make swapped requests
recompute.

The scheduler tests run the fake KV cache of test_block_sharing, which applies the swap maps in the
worker's order: a resumed request must read exactly its own tokens. The engine tests compare greedy
tokens with HF transformers on the same checkpoint.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aioengine import AsyncEngine, SamplingParams
from aioengine.engine import intake
from aioengine.scheduler.request import RequestStatus
from aioengine.scheduler.scheduler import Scheduler
from tests.helpers import final, hf_generate, wait_until_idle
from tests.test_block_sharing import FakeCache, add, make_scheduler, one_step, run
from tests.weight_swap_support import hf_model


def swapping_scheduler(num_cache_blocks: int, num_host_blocks: int, caching: bool = False) -> Scheduler:
    return make_scheduler(
        num_cache_blocks,
        max_num_seqs=8,
        budget=24,
        enable_prefix_caching=caching,
        preemption_mode="swap",
        num_host_blocks=num_host_blocks,
    )


def workload(s: Scheduler, truth: dict[str, list[int]], seed: int, count: int = 8) -> list[Any]:
    rng = random.Random(seed)
    head = [rng.randrange(3, 900) for _ in range(9)]
    groups = []
    for i in range(count):
        prompt = head[: rng.choice([0, 9])] + [rng.randrange(3, 900) for _ in range(rng.randint(1, 14))]
        params = SamplingParams(n=rng.choice([1, 1, 2]), max_tokens=12, temperature=0)
        groups.append(add(s, intake.generation_request(prompt, params, f"r{i}"), truth))
    return groups


@pytest.mark.parametrize("caching", [False, True], ids=["caching-off", "caching-on"])
@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async-scheduling"])
def test_swapped_requests_resume_reading_their_own_kv(caching: bool, in_flight: bool) -> None:
    s, cache, truth = swapping_scheduler(num_cache_blocks=16, num_host_blocks=64, caching=caching), FakeCache(), {}
    groups = workload(s, truth, seed=5)
    run(s, cache, truth, in_flight=in_flight)  # every step checks each sampling sequence's KV
    assert s.num_swapped_out > 0
    for sequences in groups:
        for r in sequences:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == [100 + 10 * r.sample_index + i for i in range(12)]
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks and s.num_host_blocks_free == 64


def test_a_full_host_pool_falls_back_to_recompute() -> None:
    s, cache, truth = swapping_scheduler(num_cache_blocks=16, num_host_blocks=3), FakeCache(), {}
    groups = workload(s, truth, seed=6)
    run(s, cache, truth)
    assert 0 < s.num_swapped_out < s.num_preemptions, "some preemptions swapped, the others recomputed"
    assert all(r.status == RequestStatus.FINISHED_LENGTH for g in groups for r in g)
    assert s.num_host_blocks_free == 3


def test_a_swapped_out_request_that_is_aborted_returns_its_host_blocks() -> None:
    s, cache, truth = swapping_scheduler(num_cache_blocks=16, num_host_blocks=64), FakeCache(), {}
    workload(s, truth, seed=5)
    swapped: list[Any] = []
    while not swapped and s.has_unfinished_requests():
        one_step(s, cache, truth)
        swapped = [r for r in s.waiting if r.swapped_blocks]
    assert swapped, "the workload swaps something out"
    s.finish_requests([swapped[0].req_id], RequestStatus.FINISHED_ABORTED)
    s.drop_swapped()  # what a weight write or a sleep does to the others
    assert s.num_host_blocks_free == 64
    assert all(not r.swapped_blocks and r.num_computed_tokens == 0 for r in s.waiting)
    run(s, cache, truth)
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


# --- on the engine, against HF ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("swap_space_bytes", "caching"),
    [(1 << 26, False), (1 << 26, True), (1, False)],
    ids=["swap", "swap+caching", "pool-too-small"],
)
async def test_swap_mode_gives_hfs_greedy_tokens_under_forced_preemption(
    make_engine: Callable[..., AsyncEngine], llama_ckpt: Path, swap_space_bytes: int, caching: bool
) -> None:
    rng = random.Random(2)
    shared = [rng.randrange(3, 1000) for _ in range(20)]
    prompts = [
        shared[: rng.choice([0, 20])] + [rng.randrange(3, 1000) for _ in range(rng.randint(5, 30))] for _ in range(12)
    ]
    expected = hf_generate(hf_model(llama_ckpt), prompts, 32)
    config = {
        "cache": {"num_blocks": 14, "swap_space_bytes": swap_space_bytes, "enable_prefix_caching": caching},
        "scheduler": {"preemption_mode": "swap"},
    }
    async with make_engine(llama_ckpt, **config) as engine:
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        outs = await asyncio.gather(*(final(engine, p, params) for p in prompts))
        stats = await wait_until_idle(engine)
    assert [o.token_ids for o in outs] == expected
    assert stats.num_preemptions > 0
    if swap_space_bytes > 1:
        assert stats.num_swapped_out > 0
    else:
        assert stats.num_swapped_out == 0 and stats.host_blocks_free == 0


async def test_weight_writes_and_sleep_make_swapped_requests_recompute(
    make_engine: Callable[..., AsyncEngine], llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with make_engine(llama_ckpt, scheduler={"preemption_mode": "swap"}) as engine:
        scheduler = engine.core.scheduler  # type: ignore[union-attr]
        assert engine.stats().host_blocks_free > 0
        calls: list[str] = []
        drop = scheduler.drop_swapped
        monkeypatch.setattr(scheduler, "drop_swapped", lambda: calls.append("drop") or drop())
        await engine.reload_weights()
        assert calls == ["drop"]
        await engine.sleep(level=1)
        assert calls == ["drop", "drop"]
        await engine.wake_up()
        assert engine.stats().host_blocks_free > 0, "the host pool is back after wake"
