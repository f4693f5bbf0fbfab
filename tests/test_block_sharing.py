"""Specification of shared KV blocks: the sequences of one prompt (n samples, scored continuations)
hold its blocks once, reference-counted, and copy a shared block before writing into it.

Driven without a model: a fake KV cache records which (position, token) every slot holds. Before each
fake forward the step's copies run, then its tokens are written; every sequence that samples must then
find exactly its own tokens in its blocks, which is what attention reads. After every step the block
manager's counts are checked against the requests holding the blocks.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from aioengine.engine import intake
from aioengine.messages import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from aioengine.sampling.params import SamplingParams
from aioengine.scheduler.kv_manager import KVBlockManager
from aioengine.scheduler.request import Request, RequestStatus
from aioengine.scheduler.scheduler import Scheduler

BLOCK = 4


class FakeCache:
    """Slots of the paged cache, each holding the (position, token) last written there."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}
        self.host: dict[tuple[int, int], tuple[int, int]] = {}
        """The host pool's slots (swap preemption)."""
        self.last_sampled: dict[str, int] = {}

    @staticmethod
    def _move(src: dict[tuple[int, int], tuple[int, int]], dst: dict[tuple[int, int], tuple[int, int]],
              blocks: dict[int, int]) -> None:  # fmt: skip
        for s, d in blocks.items():
            for off in range(BLOCK):
                if (s, off) in src:
                    dst[(d, off)] = src[(s, off)]
                else:
                    dst.pop((d, off), None)

    def run(self, sched: SchedulerOutput) -> None:
        """The worker's order (the seeds'): swap in, swap out, copy, then the forward's writes."""
        self._move(self.host, self.slots, sched.blocks_to_swap_in)
        self._move(self.slots, self.host, sched.blocks_to_swap_out)
        for src, dsts in sched.blocks_to_copy.items():
            for dst in dsts:
                for off in range(BLOCK):
                    if (src, off) in self.slots:
                        self.slots[(dst, off)] = self.slots[(src, off)]
                    else:
                        self.slots.pop((dst, off), None)
        for req in sched.requests:
            for i, token in enumerate(req.token_ids):
                if token == PLACEHOLDER_TOKEN_ID:
                    token = self.last_sampled[req.req_id]
                pos = req.start_pos + i
                self.slots[(req.block_ids[pos // BLOCK], pos % BLOCK)] = (pos, token)

    def sequence(self, req: ScheduledRequest) -> list[int]:
        """The tokens a sequence's attention reads: positions 0 .. end of its step, from its blocks."""
        out = []
        for pos in range(req.start_pos + len(req.token_ids)):
            held = self.slots.get((req.block_ids[pos // BLOCK], pos % BLOCK))
            assert held is not None and held[0] == pos, f"{req.req_id}: slot of position {pos} holds {held}"
            out.append(held[1])
        return out


def token_for(req: ScheduledRequest) -> int:
    """Samples differ from each other and from step to step, deterministically."""
    return 100 + 10 * req.sample_index + req.output_index


def execute(s: Scheduler, cache: FakeCache, truth: dict[str, list[int]], sched: SchedulerOutput) -> ModelRunnerOutput:
    """The fake worker: copies, writes, checks every sampling sequence's KV, samples."""
    cache.run(sched)
    sampling = [r for r in sched.requests if r.sample]
    for r in sampling:
        seq = cache.sequence(r)
        assert seq == truth[r.req_id][: len(seq)], f"{r.req_id} would attend to another sequence's KV"
    tokens = [token_for(r) for r in sampling]
    cache.last_sampled.update({r.req_id: t for r, t in zip(sampling, tokens, strict=True)})
    for r, t in zip(sampling, tokens, strict=True):
        truth[r.req_id] = [*truth[r.req_id][: r.start_pos + len(r.token_ids)], t]
    return ModelRunnerOutput(sched.step_id, [r.req_id for r in sampling], tokens)


def one_step(s: Scheduler, cache: FakeCache, truth: dict[str, list[int]]) -> SchedulerOutput:
    """schedule -> fake worker -> update, checking the block counts after each."""
    sched = s.schedule()
    s.kv.check(s.requests.values())
    s.update_from_output(sched, execute(s, cache, truth, sched))
    s.kv.check(s.requests.values())
    return sched


def run(
    s: Scheduler,
    cache: FakeCache,
    truth: dict[str, list[int]],
    rng: random.Random | None = None,
    in_flight: bool = False,
    steps: int = 2000,
) -> int:
    """Steps to the end; with ``rng``, preempts everything now and then; with ``in_flight``, as the engine's
    async scheduling does: step N+1 is scheduled before N's outputs are applied. Returns the steps run."""
    pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    for n in range(steps):
        if not s.has_unfinished_requests() and pending is None:
            return n
        if rng is not None and rng.random() < 0.05:
            s.preempt_all()
        if not in_flight:
            one_step(s, cache, truth)
            continue
        sched = s.schedule()
        s.kv.check(s.requests.values())
        output = execute(s, cache, truth, sched) if not sched.is_empty else None
        if pending is not None:
            s.update_from_output(*pending)
            s.kv.check(s.requests.values())
        pending = (sched, output) if output is not None else None
    raise AssertionError(f"unfinished after {steps} steps")


def make_scheduler(num_cache_blocks: int = 128, max_num_seqs: int = 16, budget: int = 32, **options: Any) -> Scheduler:
    """A scheduler on blocks of ``BLOCK`` tokens; ``options`` go to Scheduler (prefix caching, swap)."""
    return Scheduler(
        num_cache_blocks=num_cache_blocks,
        block_size=BLOCK,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=512,
        eos_token_ids=[2],
        **options,
    )


def group(request_id: str, prompt_len: int, n: int, max_tokens: int = 6) -> Request:
    prompt = [10 + i for i in range(prompt_len)]
    return intake.generation_request(prompt, SamplingParams(n=n, max_tokens=max_tokens, temperature=0), request_id)


def add(s: Scheduler, leader: Request, truth: dict[str, list[int]]) -> list[Request]:
    sequences = [leader, *leader.followers]
    for r in sequences:
        truth[r.req_id] = list(r.prompt_token_ids)
    s.add_request(leader)
    return sequences


# --- the block manager ------------------------------------------------------------------------------------


def test_a_shared_block_is_copied_for_the_writer_and_freed_only_by_its_last_holder() -> None:
    kv = KVBlockManager(8, BLOCK)
    params = SamplingParams()
    a, b = Request("a", [1] * 6, params), Request("b", [1] * 6, params)
    assert kv.allocate(a, 6)
    kv.share(a, b, 6)
    assert b.block_ids == a.block_ids and kv.num_free_blocks == 5
    kv.check([a, b])
    assert kv.allocate(b, 7, write_from=6)  # position 6 is in the shared second block
    assert b.block_ids[0] == a.block_ids[0] and b.block_ids[1] != a.block_ids[1]
    assert kv.take_copies() == {a.block_ids[1]: [b.block_ids[1]]}
    assert kv.allocate(a, 7, write_from=6)  # now a holds its block alone: it writes in place
    assert kv.take_copies() == {}
    kv.check([a, b])
    first = a.block_ids[0]
    kv.free(a)
    assert first not in [*kv._free, *kv._plain], "b still holds the first block"
    kv.free(b)
    kv.check([])
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_a_copy_on_write_that_does_not_fit_changes_nothing() -> None:
    kv = KVBlockManager(3, BLOCK)  # two usable blocks
    params = SamplingParams()
    a, b = Request("a", [1] * 6, params), Request("b", [1] * 6, params)
    assert kv.allocate(a, 6)
    kv.share(a, b, 6)
    assert not kv.allocate(b, 7, write_from=6)
    assert b.block_ids == a.block_ids and kv.take_copies() == {}
    kv.check([a, b])


# --- groups in the scheduler ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [1, 4, 5, 9, 16, 23])
def test_n_samples_compute_the_prompt_once_and_keep_their_own_kv(prompt_len: int) -> None:
    s, cache, truth = make_scheduler(), FakeCache(), {}
    sequences = add(s, group("g", prompt_len, n=5), truth)
    computed = 0
    for _ in range(3):
        sched = one_step(s, cache, truth)
        computed += sum(len(r.token_ids) for r in sched.requests if r.req_id != "0_g")
    # the others computed only the prompt's last token and then their own: never the shared part
    assert computed <= 4 * 3
    run(s, cache, truth)
    for r in sequences:
        assert r.output_token_ids == [100 + 10 * r.sample_index + i for i in range(6)]
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def test_the_group_holds_the_prompt_blocks_once() -> None:
    s, cache, truth = make_scheduler(), FakeCache(), {}
    add(s, group("g", 22, n=8, max_tokens=2), truth)  # positions 0..20 shared: blocks 0-4 full, 5 partial
    used = []
    for _ in range(2):
        sched = s.schedule()
        used.append(s.kv.num_usable_blocks - s.kv.num_free_blocks)
        cache.run(sched)
        sampling = [r for r in sched.requests if r.sample]
        tokens = [token_for(r) for r in sampling]
        cache.last_sampled.update({r.req_id: t for r, t in zip(sampling, tokens, strict=True)})
        s.update_from_output(sched, ModelRunnerOutput(sched.step_id, [r.req_id for r in sampling], tokens))
    # 5 full shared blocks + each sample's own copy of the partial one (positions 20..23), where
    # 8 separate requests would hold 8 * 6
    assert used[:2] == [6, 5 + 8]


@pytest.mark.parametrize("in_flight", [False, True], ids=["sync", "async-scheduling"])
def test_groups_stay_consistent_under_constant_preemption(in_flight: bool) -> None:
    rng = random.Random(0)
    s, cache, truth = make_scheduler(num_cache_blocks=24, max_num_seqs=12, budget=16), FakeCache(), {}
    groups = [add(s, group(f"g{i}", rng.randint(1, 14), n=rng.randint(1, 4), max_tokens=8), truth) for i in range(6)]
    run(s, cache, truth, rng, in_flight)
    assert s.num_preemptions > 0
    for sequences in groups:
        for r in sequences:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == [100 + 10 * r.sample_index + i for i in range(8)]
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def test_aborting_the_leader_before_the_group_forked_lets_the_next_sequence_lead() -> None:
    s, cache, truth = make_scheduler(budget=4), FakeCache(), {}
    sequences = add(s, group("g", 10, n=3), truth)
    one_step(s, cache, truth)  # the leader's first chunk only: nothing forked yet
    assert all(r.status == RequestStatus.WAITING for r in sequences[1:])
    s.finish_requests(["0_g"], RequestStatus.FINISHED_ABORTED)
    run(s, cache, truth)
    assert [len(r.output_token_ids) for r in sequences] == [0, 6, 6]
    assert s.kv.num_free_blocks == s.kv.num_usable_blocks


def test_a_group_waits_until_all_its_sequences_fit_in_max_num_seqs() -> None:
    s, cache, truth = make_scheduler(max_num_seqs=4), FakeCache(), {}
    add(s, group("a", 3, n=2), truth)
    add(s, group("b", 3, n=3), truth)
    one_step(s, cache, truth)
    assert len(s.running) == 1 + 1  # a's leader and its forked sample; b (3 sequences) would make 5
    run(s, cache, truth)
