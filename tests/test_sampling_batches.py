"""Specification of the sampler across the rows of a batch and of what it hands back.

Rows without controls stay bit-identical beside a controlled one, the metadata turns on only the controls some
row uses, an all-greedy batch is one argmax, the input logits are left as they are, processed logits follow each
row and come only when asked for, bad inputs are refused; seeded samples (``row_seed``) depend on their seed,
output index and sample index alone; ``gather_logprobs`` matches a direct computation. The row of logits,
``run`` and the references are those of test_sampling_controls.py.
"""

from __future__ import annotations

import pytest
import torch

from aioengine.sampling.params import SamplingParams
from aioengine.sampling.sampler import Sampler, SamplingMetadata, gather_logprobs, row_seed
from tests.test_sampling_controls import GREEDY, ROW, V, assert_rows_close, ref_processed, run

# --- batches -----------------------------------------------------------------------------------------


def _batch(controlled: SamplingParams | None) -> tuple[list[SamplingParams], list[tuple[list[int], int] | None]]:
    """Plain rows (seeded random, greedy, seeded top-p) around row 1, which ``controlled`` replaces."""
    params = [
        SamplingParams(seed=1),
        SamplingParams(**GREEDY),
        SamplingParams(seed=2, top_p=0.9),
        SamplingParams(**GREEDY),
    ]
    histories: list[tuple[list[int], int] | None] = [None] * 4
    if controlled is not None:
        params[1] = controlled
        histories[1] = ([1, 2, 3, 3], 2)
    return params, histories


def test_rows_without_controls_are_bit_identical_beside_a_controlled_row():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    controlled = SamplingParams(
        temperature=0.9,
        seed=3,
        min_p=0.2,
        logit_bias={7: 5.0},
        allowed_token_ids=list(range(100)),
        bad_words_token_ids=[[3, 9]],
        repetition_penalty=1.4,
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    params, _ = _batch(None)
    plain = run(params, logits)
    params, histories = _batch(controlled)
    mixed = run(params, logits, histories=histories, banned=[None, [0, 1], None, None])
    assert plain.processed_logits is not None and mixed.processed_logits is not None
    others = [0, 2, 3]
    assert torch.equal(mixed.token_ids[others], plain.token_ids[others])
    assert torch.equal(mixed.processed_logits[others], plain.processed_logits[others])
    assert not torch.equal(mixed.processed_logits[1], plain.processed_logits[1])


def test_metadata_leaves_every_control_off_when_no_row_uses_it():
    meta = SamplingMetadata.build([SamplingParams(), SamplingParams(**GREEDY)], [0, 0], "cpu", vocab_size=V)
    assert meta.min_p is None and meta.disallowed is None and meta.banned is None
    assert meta.logit_bias is None and meta.penalties is None and not meta.return_processed


def _fields(meta: SamplingMetadata) -> dict[str, object]:
    return {
        name: value.tolist() if isinstance(value, torch.Tensor) else value
        for name in SamplingMetadata.__dataclass_fields__
        for value in [getattr(meta, name)]
    }


@pytest.mark.parametrize("processed", [False, True])
def test_plain_greedy_rows_take_the_short_way_to_what_the_general_one_makes(monkeypatch, processed):
    import aioengine.sampling.sampler as sampler

    params = [SamplingParams(**GREEDY), SamplingParams(**GREEDY, seed=3, top_k=5, min_p=0.2, max_tokens=9)]
    args = (params, [0, 4], "cpu")
    kwargs = dict(vocab_size=V, banned=[None, []], processed=processed)
    short = SamplingMetadata.build(*args, **kwargs)
    monkeypatch.setattr(sampler, "plain_greedy", lambda p: False)
    general = SamplingMetadata.build(*args, **kwargs)
    assert _fields(short) == _fields(general) and short.argmax_only != processed


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"logprobs": 0},
        {"logprobs": 2, "logprobs_mode": "processed"},
        {"temperature": 0.7, "seed": 1},
        {"min_tokens": 3},
        {"min_tokens": 3, "stop_token_ids": [5]},
        {"min_tokens": 3, "ignore_eos": True},
        {"min_tokens": 1, "ignore_eos": True},
        {"allowed_token_ids": [1, 2]},
        {"logit_bias": {3: 1.0}},
        {"frequency_penalty": 0.5},
    ],
)
@pytest.mark.parametrize("output_index", [0, 2, 3])
def test_the_runners_short_way_is_taken_only_where_the_metadata_would_be_an_argmax_without_logprobs(
    change: dict, output_index: int
) -> None:
    """The model runner skips ``SamplingMetadata`` where every row takes its raw argmax (``RawArgmaxRows``): it
    must say so only of rows whose metadata, packed the long way (``sampling_metadata``), is ``argmax_only``
    and asks no logprobs."""
    from aioengine.messages import ScheduledRequest
    from aioengine.worker.step_sampling import RawArgmaxRows, sampling_metadata

    params = SamplingParams(**{**GREEDY, **change})
    req = ScheduledRequest("r", [7], 10, [0], params, output_index, 0, [1] * 10 if params.uses_history else None, 4)
    meta = sampling_metadata([req], "cpu", vocab_size=V, eos_token_ids=[2], model_vocab_size=V)  # the long way
    long_way = meta.argmax_only and params.logprobs is None
    # Both ways agree, save where min_tokens bans nothing the row could pick (no stop id, EOS ignored): the
    # short way then declines a row the long way would take, and the long way answers it as before.
    short_way = RawArgmaxRows().all_take_it([req])
    assert short_way == long_way or (not short_way and long_way and output_index < params.min_tokens)


@pytest.mark.parametrize(
    "control",
    [
        {"allowed_token_ids": [1, 2]},
        {"logit_bias": {3: 1.0}},
        {"presence_penalty": 0.5},
        {"bad_words_token_ids": [[4]]},
    ],
)
def test_a_greedy_row_with_a_control_or_a_ban_keeps_it(control):
    params = [SamplingParams(**GREEDY), SamplingParams(**GREEDY, **control)]
    meta = SamplingMetadata.build(params, [0, 0], "cpu", vocab_size=V, histories=[None, ([4], 1)])
    assert meta.all_greedy and not meta.argmax_only
    banned = SamplingMetadata.build([SamplingParams(**GREEDY)] * 2, [0, 0], "cpu", vocab_size=V, banned=[None, [1]])
    assert banned.banned is not None and not banned.argmax_only


def test_all_greedy_batch_without_controls_is_one_argmax_of_the_logits_themselves():
    seen: list[torch.Tensor] = []

    def spy(x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return x.argmax(dim=-1)

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    meta = SamplingMetadata.build([SamplingParams(**GREEDY)] * 3, [0] * 3, "cpu", vocab_size=50)
    out = Sampler(argmax=spy)(logits, meta)
    assert len(seen) == 1 and seen[0] is logits
    assert torch.equal(out.token_ids, logits.argmax(dim=-1)) and out.processed_logits is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_input_logits_are_unchanged(dtype):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2)).to(dtype)
    before = logits.clone()
    params = [
        SamplingParams(logit_bias={1: 3.0}, allowed_token_ids=[1, 2, 3], min_p=0.1, top_k=2),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, bad_words_token_ids=[[4]], **GREEDY),
        SamplingParams(**GREEDY),
        SamplingParams(top_p=0.5),
    ]
    histories = [None, ([4, 5, 6], 1), None, None]
    out = run(params, logits, histories=histories, banned=[[2], None, [0], None])
    assert torch.equal(logits, before)
    assert out.processed_logits is not None and out.processed_logits.dtype == torch.float32
    assert out.token_ids.dtype == torch.int64


def test_processed_logits_follow_each_row_of_a_mixed_batch():
    prompt, output = [0, 1], [2, 2]
    params = [
        SamplingParams(temperature=0.5, top_k=4, logit_bias={9: 4.0}),
        SamplingParams(frequency_penalty=1.0, allowed_token_ids=[2, 3, 8], **GREEDY),
        SamplingParams(temperature=1.3, top_p=0.6, repetition_penalty=1.2),
    ]
    history = (prompt + output, len(prompt))
    out = run(params, histories=[None, history, history], banned=[None, [8], None])
    assert out.processed_logits is not None
    assert_rows_close(out.processed_logits[0].tolist(), ref_processed(params[0], [], [], banned=[]))
    assert_rows_close(out.processed_logits[1].tolist(), ref_processed(params[1], prompt, output, banned=[8]))
    assert_rows_close(out.processed_logits[2].tolist(), ref_processed(params[2], prompt, output, banned=[]))
    assert out.token_ids[1] == 3


def test_greedy_processed_logits_keep_tokens_other_rows_top_p_would_drop():
    # A token 200 below the top has probability 0 in float32, which a top-p of 1.0 would still drop.
    logits = torch.tensor([[3.0, -200.0, 0.0, 1.0]] * 2)
    out = run([SamplingParams(top_p=0.5), SamplingParams(logit_bias={2: 1.0}, **GREEDY)], logits)
    assert out.processed_logits is not None
    assert out.processed_logits[1].tolist() == [3.0, -200.0, 1.0, 1.0]


def test_processed_logits_are_none_unless_asked_for():
    assert (
        run([SamplingParams(), SamplingParams(logit_bias={1: 1.0}, **GREEDY)], processed=False).processed_logits is None
    )


def test_a_row_using_history_without_one_is_refused():
    with pytest.raises(ValueError, match="history"):
        run([SamplingParams(presence_penalty=1.0)], histories=[None])


def test_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="logit_bias"):
        run([SamplingParams(logit_bias={V: 1.0})])
    with pytest.raises(ValueError, match="banned"):
        run([SamplingParams()], banned=[[V + 3]])


# --- row_seed ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "output_index", "expected"),
    [(0, 0, 6017775124710473527), (42, 7, 793502930448478848), (2**63 + 5, 123, 4295796606147607190)],
)
def test_row_seed_of_sample_zero_is_the_single_sample_seed(seed, output_index, expected):
    # Values of row_seed(seed, output_index) before sample indices existed.
    assert row_seed(seed, output_index) == expected
    assert row_seed(seed, output_index, 0) == expected


def test_row_seed_differs_per_sample_index():
    seeds = {row_seed(42, i, s) for i in range(20) for s in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)


# --- seeded samples ----------------------------------------------------------------------------------


def _seeded(logits_row: torch.Tensor, seed: int, output_index: int, sample_index: int) -> int:
    params = [SamplingParams(seed=seed)]
    out = run(params, logits_row[None], output_indices=[output_index], sample_indices=[sample_index], processed=False)
    return int(out.token_ids[0])


def test_seeded_sample_ignores_the_rest_of_the_batch():
    row = torch.randn(500, generator=torch.Generator().manual_seed(3))
    others = torch.randn(3, 500, generator=torch.Generator().manual_seed(4))
    mine = SamplingParams(seed=42)
    crowd = [SamplingParams(logit_bias={1: 2.0}), SamplingParams(**GREEDY), SamplingParams(seed=42), mine]
    for n in range(20):
        alone = _seeded(row, 42, n, 2)
        out = run(crowd, torch.cat([others, row[None]]), output_indices=[5, 0, n, n], sample_indices=[0, 0, 1, 2])
        assert int(out.token_ids[3]) == alone


def test_sample_zero_draws_what_a_single_sample_request_draws():
    row = torch.randn(500, generator=torch.Generator().manual_seed(5))
    single = [int(run([SamplingParams(seed=9)], row[None], output_indices=[n]).token_ids[0]) for n in range(20)]
    assert [_seeded(row, 9, n, 0) for n in range(20)] == single


def test_different_sample_indices_give_independent_draws():
    uniform = torch.zeros(1000)
    streams = [[_seeded(uniform, 42, n, s) for n in range(50)] for s in range(3)]
    assert streams[0] != streams[1] and streams[1] != streams[2] and streams[0] != streams[2]
    # At one output position, 200 sample indices draw like 200 uniform draws over 1000 (~181 distinct).
    assert len({_seeded(uniform, 42, 0, s) for s in range(200)}) > 150


# --- gather_logprobs ---------------------------------------------------------------------------------


def _direct_logprobs(logprobs: torch.Tensor, chosen: list[int], k: int) -> list[tuple[int, float, int]]:
    rows = []
    for r, row in enumerate(logprobs.tolist()):
        c = chosen[r]
        rows.append((c, row[c], sum(x >= row[c] for x in row)))
    return rows


@pytest.mark.parametrize("k", [0, 1, 3, V])
def test_gather_logprobs_matches_a_direct_computation(k):
    logits = torch.tensor([ROW, [1.0, 1.0, 0.0, 2.0, 2.0, 2.0, -1.0, 0.0, 1.0, -5.0, 0.5, 0.5]])
    logprobs = logits.log_softmax(dim=-1)
    chosen = [5, 0]  # in row 1, token 0 ties with 1 and 8 below three tied maxima
    ids, values, ranks = gather_logprobs(logprobs, torch.tensor(chosen), k)
    assert ids.shape == values.shape == ranks.shape == (2, 1 + k)
    assert ids.dtype == ranks.dtype == torch.int64 and values.dtype == torch.float32
    for r, (c, value, rank) in enumerate(_direct_logprobs(logprobs, chosen, k)):
        assert (ids[r, 0].item(), values[r, 0].item(), ranks[r, 0].item()) == (c, value, rank)
        row = logprobs[r].tolist()
        top = sorted(row, reverse=True)[:k]
        assert values[r, 1:].tolist() == top
        assert [row[t] for t in ids[r, 1:].tolist()] == top and len(set(ids[r, 1:].tolist())) == k
        assert ranks[r, 1:].tolist() == list(range(1, k + 1))
    assert ranks[0, 0].item() == 8  # no ties: 1 + the number of larger entries
    assert ranks[1, 0].item() == 6  # tied with two others: they all count


def test_gather_logprobs_ranks_the_unique_argmax_first():
    logprobs = torch.tensor([ROW]).log_softmax(dim=-1)
    ids, _, ranks = gather_logprobs(logprobs, torch.tensor([3]), 2)
    assert ids.tolist() == [[3, 3, 8]] and ranks.tolist() == [[1, 1, 2]]


def test_a_steps_rows_at_once_answer_as_each_row_does_and_each_sampling_object_is_judged_as_itself():
    """``RawArgmaxRows`` keeps the half of its answer a request's sampling decides, by object: over steps that mix
    rows (min_tokens reached or not, controls, logprobs, a copy with another temperature) it answers as the rows
    one by one do, each judged anew, and a full store starts again rather than answer for an object it did not
    judge."""
    from aioengine.messages import ScheduledRequest
    from aioengine.worker.step_sampling import RawArgmaxRows

    plain = SamplingParams(**GREEDY)
    short = SamplingParams(**GREEDY, min_tokens=3)
    sampled = plain.model_copy(update={"temperature": 0.8})  # a new object: judged as itself, not as ``plain``
    kinds = [plain, short, sampled, SamplingParams(**GREEDY, logprobs=1), SamplingParams(**GREEDY, logit_bias={3: 1.0})]

    def row(params: SamplingParams | None, output_index: int) -> ScheduledRequest:
        return ScheduledRequest("r", [7], 10, [0], params, output_index, 0, None, 4)

    rows = RawArgmaxRows(limit=3)
    steps = [
        [row(plain, 5)] * 4,
        [row(plain, 5), row(short, 1)],
        [row(plain, 5), row(short, 3)],
        [row(plain, 5), row(sampled, 5)],
        [row(plain, 5), row(None, 0)],
        *[[row(plain, 5), row(kind, 5)] for kind in kinds],
        *[[row(kind, 5)] for kind in reversed(kinds)],
    ]
    for reqs in steps:
        assert rows.all_take_it(reqs) == all(RawArgmaxRows().all_take_it([r]) for r in reqs)
    assert len(rows.takes_it._judged) <= rows.takes_it.limit
    assert rows.all_take_it([row(plain, 5)]) and not rows.all_take_it([row(sampled, 5)])
