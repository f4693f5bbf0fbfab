"""Specification of automatic prefix caching: full blocks keyed by a hash chain of their tokens (plus the
weights version and a per-request salt), reused by later requests, kept after free until evicted least
recently used first, and never stale.

The block-level tests drive the scheduler without a model and check the fake KV cache of
test_block_sharing: a reused block must hold exactly the tokens the request would have computed there.
The engine tests compare greedy tokens with HF transformers on the same checkpoint.
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
from aioengine.errors import EngineStateError
from aioengine.scheduler.request import Request, RequestStatus
from aioengine.scheduler.scheduler import Scheduler
from tests.helpers import TIMEOUT, final, hf_generate, wait_until_idle
from tests.test_block_sharing import BLOCK, FakeCache, add, make_scheduler, one_step, run
from tests.weight_swap_support import hf_model

# --- the block manager and the scheduler ----------------------------------------------------------------------


def caching_scheduler(num_cache_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64) -> Scheduler:
    return make_scheduler(num_cache_blocks, max_num_seqs, budget, enable_prefix_caching=True)


def request(req_id: str, tokens: list[int], max_tokens: int = 3, salt: str | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(temperature=0, max_tokens=max_tokens), cache_salt=salt)


def finish(s: Scheduler, cache: FakeCache, truth: dict[str, list[int]], *requests: Request) -> None:
    for r in requests:
        truth[r.req_id] = list(r.prompt_token_ids)
        s.add_request(r)
    run(s, cache, truth)


def cached_tokens(s: Scheduler, r: Request) -> int:
    return len(s.kv.cached_prefix(r)) * BLOCK


PREFIX = list(range(10, 34))  # 24 tokens: 6 full blocks


def test_equal_prefixes_share_blocks_and_a_different_token_in_block_k_shares_only_blocks_before_k() -> None:
    s, cache, truth = caching_scheduler(), FakeCache(), {}
    finish(s, cache, truth, request("a", [*PREFIX, 99, 98]))
    assert cached_tokens(s, request("same", [*PREFIX, 99, 98])) == 24  # not the block with the last token
    for k in range(6):
        changed = list(PREFIX)
        changed[k * BLOCK + 1] = 500
        assert cached_tokens(s, request(f"k{k}", [*changed, 1, 2])) == k * BLOCK
    assert cached_tokens(s, request("other", [7] * 30)) == 0


def test_a_request_never_reuses_the_block_holding_its_last_prompt_token() -> None:
    s, cache, truth = caching_scheduler(), FakeCache(), {}
    finish(s, cache, truth, request("a", PREFIX))
    again = request("b", PREFIX)  # 6 full blocks, the last holds the last token
    assert cached_tokens(s, again) == 5 * BLOCK
    s.add_request(again)
    sched = s.schedule()
    assert [(r.start_pos, len(r.token_ids)) for r in sched.requests] == [(20, 4)]


def test_cache_salt_and_weights_version_separate_equal_prefixes() -> None:
    s, cache, truth = caching_scheduler(), FakeCache(), {}
    finish(s, cache, truth, request("a", [*PREFIX, 1], salt="tenant-1"))
    assert cached_tokens(s, request("b", [*PREFIX, 1], salt="tenant-1")) == 24
    assert cached_tokens(s, request("c", [*PREFIX, 1], salt="tenant-2")) == 0
    assert cached_tokens(s, request("d", [*PREFIX, 1])) == 0
    s.kv.weights_version = 1  # as after a weight write, were the cache not emptied too
    assert cached_tokens(s, request("e", [*PREFIX, 1], salt="tenant-1")) == 0


def test_hits_skip_the_computation_and_the_kv_read_is_the_prefixes() -> None:
    s, cache, truth = caching_scheduler(), FakeCache(), {}
    finish(s, cache, truth, request("a", [*PREFIX, 40, 41, 42]))
    later = request("b", [*PREFIX, 50, 51])
    truth["b"] = list(later.prompt_token_ids)
    s.add_request(later)
    sched = one_step(s, cache, truth)  # checks the sequence read from the blocks equals b's own tokens
    assert [(r.start_pos, len(r.token_ids)) for r in sched.requests] == [(24, 2)]
    assert (s.kv.num_query_tokens, s.kv.num_hit_tokens) == (27 + 26, 24)


def test_freed_blocks_stay_cached_until_needed_and_the_oldest_go_first() -> None:
    s, cache, truth = caching_scheduler(num_cache_blocks=1 + 16), FakeCache(), {}
    first, second = [1000 + i for i in range(25)], [2000 + i for i in range(25)]
    finish(s, cache, truth, request("a", first, max_tokens=1))
    finish(s, cache, truth, request("b", second, max_tokens=1))
    assert s.kv.num_free_blocks == 16 and s.kv.num_cached_blocks == 12
    # 7 new blocks: taken from the free queue's front, the blocks "a" freed (its last blocks first)
    finish(s, cache, truth, request("c", [3000 + i for i in range(25)], max_tokens=1))
    assert cached_tokens(s, request("b2", second)) == 24, "the most recently freed prefix survives"
    assert cached_tokens(s, request("a2", first)) < 24
    s.kv.check(s.requests.values())


def test_blocks_without_a_prefix_are_handed_out_again_before_fresh_or_cached_ones() -> None:
    """Without prefix caching every freed block is reused before an untouched one, so requests one after
    another cycle through as many blocks as they hold at once, not through the whole cache (whose host
    pages the OS maps as they are first written); with it, a request's partial last block and the untouched
    blocks go before any cached prefix is evicted."""
    from aioengine.scheduler.kv_manager import KVBlockManager

    kv = KVBlockManager(1 + 64, BLOCK)
    used: set[int] = set()
    for i in range(20):
        r = request(f"r{i}", list(range(100, 100 + 5 * BLOCK - i % 3)))
        assert kv.allocate(r, len(r.token_ids))
        used.update(r.block_ids)
        kv.free(r)
        kv.check([])
    assert used == {1, 2, 3, 4, 5}

    s, cache, truth = caching_scheduler(num_cache_blocks=1 + 16), FakeCache(), {}
    first, second = [1000 + i for i in range(25)], [2000 + i for i in range(25)]
    finish(s, cache, truth, request("a", first, max_tokens=1))
    finish(s, cache, truth, request("b", second, max_tokens=1))
    # Free now: a's and b's 6 cached blocks each, their partial last blocks and 2 untouched ones.
    finish(s, cache, truth, request("c", [3000 + i for i in range(25)], max_tokens=1))  # 7 blocks
    # The 4 without a prefix went first, then a's 3 last ones (the oldest cached): its first 3 survive.
    assert cached_tokens(s, request("a2", first)) == 3 * BLOCK
    assert cached_tokens(s, request("b2", second)) == 24
    s.kv.check(s.requests.values())
    assert s.kv.reset(weights_version=1) == 3 + 6 + 6  # every cached block is free: all go on top
    s.kv.check(s.requests.values())
    assert s.kv.num_free_blocks == 16


def test_a_hit_on_a_free_block_takes_it_out_of_the_free_queue() -> None:
    s, cache, truth = caching_scheduler(), FakeCache(), {}
    finish(s, cache, truth, request("a", [*PREFIX, 1], max_tokens=1))
    free = s.kv.num_free_blocks
    b = request("b", [*PREFIX, 1], max_tokens=50)
    truth["b"] = list(b.prompt_token_ids)
    s.add_request(b)
    one_step(s, cache, truth)
    assert s.kv.num_free_blocks == free - 7  # 6 reused (they leave the queue) + 1 for the last token
    s.kv.check(s.requests.values())


def test_requests_in_flight_at_a_reset_never_offer_their_blocks() -> None:
    s, cache, truth = caching_scheduler(), FakeCache(), {}
    old = request("old", [*PREFIX, 1], max_tokens=8)
    truth["old"] = list(old.prompt_token_ids)
    s.add_request(old)
    one_step(s, cache, truth)
    assert s.kv.reset(weights_version=1) == 6
    run(s, cache, truth)
    assert s.kv.num_cached_blocks == 0, "KV computed before the reset is never cached after it"
    finish(s, cache, truth, request("new", [*PREFIX, 1]))
    assert cached_tokens(s, request("again", [*PREFIX, 1])) == 24


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async-scheduling"])
def test_shared_prefixes_under_constant_preemption_keep_every_block_accounted(in_flight: bool) -> None:
    rng = random.Random(3)
    s, cache, truth = caching_scheduler(num_cache_blocks=30, max_num_seqs=10, budget=24), FakeCache(), {}
    heads = [[rng.randrange(3, 900) for _ in range(rng.choice([0, 4, 9, 16]))] for _ in range(3)]
    groups = []
    for i in range(14):
        prompt = rng.choice(heads) + [rng.randrange(3, 900) for _ in range(rng.randint(1, 6))]
        params = SamplingParams(n=rng.choice([1, 1, 2, 3]), max_tokens=6, temperature=0)
        groups.append(add(s, intake.generation_request(prompt, params, f"g{i}"), truth))
    run(s, cache, truth, rng, in_flight)
    assert s.num_preemptions > 0 and s.kv.num_hit_tokens > 0
    for sequences in groups:
        for r in sequences:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == [100 + 10 * r.sample_index + i for i in range(6)]
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


# --- on the engine, against HF ----------------------------------------------------------------------------------


SYSTEM = [(7 * i + 3) % 1000 + 3 for i in range(40)]  # 40 tokens: 2 full blocks of 16 and part of a third


def prompts_sharing(prefix_len: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [SYSTEM[:prefix_len] + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 20))] for _ in range(count)]


@pytest.mark.parametrize("prefix_len", [0, 16, 40], ids=["no-block", "one-block", "many"])
async def test_greedy_tokens_equal_hf_with_caching_on_concurrent_and_one_after_another(
    llama_engine: AsyncEngine, llama_ckpt: Path, prefix_len: int
) -> None:
    prompts = prompts_sharing(prefix_len, 6, seed=prefix_len)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = hf_generate(hf_model(llama_ckpt), prompts, 12)
    before = llama_engine.stats().prefix_cache_hits
    for prompt, want in zip(prompts, expected, strict=True):
        assert (await final(llama_engine, prompt, params)).token_ids == want
    outs = await asyncio.gather(*(final(llama_engine, p, params) for p in prompts))
    assert [o.token_ids for o in outs] == expected
    hits = llama_engine.stats().prefix_cache_hits - before
    assert hits >= (6 if prefix_len else 1) * (prefix_len // 16) * 16, "the shared blocks were reused"


async def test_caching_is_on_by_default_and_stats_give_the_hit_rate(llama_engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=2)
    await final(llama_engine, SYSTEM, params)
    await final(llama_engine, SYSTEM, params)
    stats = await wait_until_idle(llama_engine)
    assert stats.prefix_cache_queries == 80 and stats.prefix_cache_hits == 32
    assert stats.prefix_cache_hit_rate == pytest.approx(0.4) and stats.to_dict()["prefix_cache_hit_rate"] == 0.4
    assert stats.prefix_cache_blocks >= 2


async def test_a_cached_prompt_gives_the_new_models_tokens_after_a_weight_update(
    llama_engine: AsyncEngine, llama_ckpt: Path, ckpt_b: Path
) -> None:
    prompt = [*SYSTEM, 5, 6, 7]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert (await final(llama_engine, prompt, params)).token_ids == hf_generate(hf_model(llama_ckpt), [prompt], 10)[0]
    assert llama_engine.stats().prefix_cache_blocks > 0
    await llama_engine.update_weights(str(ckpt_b))
    assert llama_engine.stats().prefix_cache_blocks == 0
    assert (await final(llama_engine, prompt, params)).token_ids == hf_generate(hf_model(ckpt_b), [prompt], 10)[0]


async def test_a_weight_write_through_collective_rpc_empties_the_cache_too(
    llama_engine: AsyncEngine, ckpt_b: Path
) -> None:
    await final(llama_engine, SYSTEM, SamplingParams(temperature=0, max_tokens=2))
    assert llama_engine.stats().prefix_cache_blocks > 0
    await llama_engine.collective_rpc("update_weights", (str(ckpt_b),))
    assert llama_engine.stats().prefix_cache_blocks == 0


async def test_sleep_empties_the_cache(llama_engine: AsyncEngine, llama_ckpt: Path) -> None:
    prompt = [*SYSTEM, 9]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    await final(llama_engine, prompt, params)
    await llama_engine.sleep(level=1)
    assert llama_engine.stats().prefix_cache_blocks == 0
    await llama_engine.wake_up()
    hits = llama_engine.stats().prefix_cache_hits
    assert (await final(llama_engine, prompt, params)).token_ids == hf_generate(hf_model(llama_ckpt), [prompt], 6)[0]
    assert llama_engine.stats().prefix_cache_hits == hits, "nothing cached before the sleep was reused"


async def test_reset_prefix_cache_is_refused_while_requests_run_unless_forced(llama_engine: AsyncEngine) -> None:
    await final(llama_engine, SYSTEM, SamplingParams(temperature=0, max_tokens=2))
    agen = llama_engine.generate(SYSTEM, SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    await asyncio.wait_for(agen.__anext__(), TIMEOUT)
    with pytest.raises(EngineStateError, match="force=True"):
        await llama_engine.reset_prefix_cache()
    assert await llama_engine.reset_prefix_cache(force=True) >= 2
    await agen.aclose()
    await wait_until_idle(llama_engine)
    await final(llama_engine, SYSTEM, SamplingParams(temperature=0, max_tokens=2))
    assert await llama_engine.reset_prefix_cache() >= 2
    assert llama_engine.stats().prefix_cache_blocks == 0


@pytest.mark.parametrize("caching", [True, False], ids=["caching-on", "caching-off"])
async def test_under_constant_preemption_tokens_equal_hf_and_no_block_is_lost(
    make_engine: Callable[..., AsyncEngine], llama_ckpt: Path, caching: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = prompts_sharing(40, 10, seed=1) + prompts_sharing(16, 6, seed=2)
    expected = hf_generate(hf_model(llama_ckpt), prompts, 24)
    async with make_engine(llama_ckpt, cache={"num_blocks": 14, "enable_prefix_caching": caching}) as engine:
        scheduler = engine.core.scheduler  # type: ignore[union-attr]
        schedule = scheduler.schedule
        checks: list[int] = []

        def checked() -> Any:
            out = schedule()
            scheduler.kv.check(scheduler.requests.values())
            checks.append(1)
            return out

        monkeypatch.setattr(scheduler, "schedule", checked)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = await asyncio.gather(*(final(engine, p, params) for p in prompts))
        stats = await wait_until_idle(engine)
    assert [o.token_ids for o in outs] == expected
    assert stats.num_preemptions > 0 and len(checks) > 50
    assert (stats.prefix_cache_hits > 0) == caching
