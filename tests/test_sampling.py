"""Specification of SamplingParams validation and of the batched Sampler."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from aioengine.sampling.params import SamplingParams
from aioengine.sampling.sampler import Sampler, SamplingMetadata

sampler = Sampler()


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices=None) -> torch.Tensor:
    indices = output_indices if output_indices is not None else [0] * len(params)
    meta = SamplingMetadata.build(params, indices, logits.device, vocab_size=logits.shape[-1])
    return sampler(logits, meta).token_ids


def seeded_token(logits_row: torch.Tensor, seed: int, output_index: int) -> int:
    return int(sample(logits_row[None], [SamplingParams(seed=seed)], [output_index])[0])


# --- SamplingParams -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_tokens", {"max_tokens": 0}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"min_tokens": 5, "max_tokens": 3}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": float("nan")}),
        ("top_k", {"top_k": -2}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("stop", {"stop": ["ok", ""]}),
        ("stop", {"stop": ""}),
        ("stop_token_ids", {"stop_token_ids": [2, -1]}),
        ("bogus", {"bogus": 1}),
    ],
)
def test_bad_value_raises_validation_error_naming_the_field(field, kwargs):
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**kwargs)


def test_validation_message_states_the_rule():
    with pytest.raises(ValidationError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)


def test_stop_given_as_str_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


def test_top_k_minus_one_normalises_to_zero():
    assert SamplingParams(top_k=-1).top_k == 0


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


def test_metadata_leaves_top_k_and_top_p_off_when_no_row_uses_them():
    params = [SamplingParams(), SamplingParams(temperature=0, top_k=5)]
    meta = SamplingMetadata.build(params, [0, 0], "cpu", vocab_size=10)
    assert meta.top_k is None and meta.top_p is None
    assert not meta.all_greedy and not meta.all_random


# --- greedy ---------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    tokens = sample(logits, [SamplingParams(temperature=0)] * 8)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens.dtype == torch.int64


def test_greedy_rows_stay_exact_in_a_mixed_batch():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0 if i % 2 else 1.5, top_p=0.95) for i in range(16)]
    tokens = sample(logits, params)
    assert torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))


def test_sampler_does_not_modify_the_logits():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8), SamplingParams(temperature=0)]
    sample(logits, params * 2)
    assert torch.equal(logits, before)


# --- seeded ---------------------------------------------------------------------------------


def test_seeded_token_ignores_batch_position_composition_and_other_seeds():
    row = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    others = torch.randn(3, 1000, generator=torch.Generator().manual_seed(4))
    mine = SamplingParams(seed=42)
    for n in range(20):
        alone = sample(row[None], [mine], [n])[0]
        batch = torch.cat([others, row[None]])
        crowd = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=7), mine]
        in_batch = sample(batch, crowd, [5, 0, n + 3, n])[3]
        assert alone == in_batch


def test_seeded_stream_varies_with_output_index():
    uniform = torch.zeros(1000)
    tokens = {seeded_token(uniform, seed=42, output_index=n) for n in range(200)}
    assert len(tokens) > 150  # ~181 distinct expected from 200 uniform draws over 1000


def test_different_seeds_give_different_streams():
    uniform = torch.zeros(1000)
    a = [seeded_token(uniform, seed=1, output_index=n) for n in range(50)]
    b = [seeded_token(uniform, seed=2, output_index=n) for n in range(50)]
    assert a != b


def test_seeded_sampling_is_identical_across_runs():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(seed=s, temperature=0.8, top_p=0.9) for s in range(6)]
    first = sample(logits, params, list(range(6)))
    second = sample(logits, params, list(range(6)))
    assert torch.equal(first, second)


# --- top-k / top-p --------------------------------------------------------------------------


def test_top_k_one_is_argmax_even_at_high_temperature():
    logits = torch.randn(64, 200, generator=torch.Generator().manual_seed(6))
    tokens = sample(logits, [SamplingParams(temperature=100.0, top_k=1)] * 64)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_never_samples_outside_the_k_largest():
    torch.manual_seed(0)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(7)).expand(4000, 50)
    tokens = sample(logits, [SamplingParams(temperature=3.0, top_k=5)] * 4000)
    allowed = set(logits[0].topk(5).indices.tolist())
    assert set(tokens.tolist()) <= allowed
    assert len(set(tokens.tolist())) == 5


def test_tiny_top_p_is_argmax():
    logits = torch.randn(64, 200, generator=torch.Generator().manual_seed(8))
    tokens = sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * 64)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_p_never_samples_outside_the_nucleus():
    torch.manual_seed(0)
    # Sorted probabilities 0.5, 0.3, 0.15, 0.05 (ids 3, 0, 2, 1): cumulative 0.5, 0.8, 0.95,
    # so the 0.9 nucleus is ids {3, 0, 2} and id 1 is outside it.
    probs = torch.tensor([0.3, 0.05, 0.15, 0.5])
    logits = probs.log().expand(4000, 4)
    tokens = sample(logits, [SamplingParams(top_p=0.9)] * 4000)
    assert set(tokens.tolist()) == {0, 2, 3}


def test_top_k_and_top_p_apply_per_row():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(9)).expand(2, 100)
    params = [SamplingParams(temperature=50, top_k=1), SamplingParams(temperature=0.5, top_p=1e-6)]
    tokens = sample(logits, params)
    assert tokens.tolist() == [int(logits[0].argmax())] * 2


# --- distribution ---------------------------------------------------------------------------


def test_temperature_one_matches_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    draws = 20_000
    tokens = sample(logits.expand(draws, 4), [SamplingParams()] * draws)
    empirical = torch.bincount(tokens, minlength=4).float() / draws
    assert torch.allclose(empirical, logits.softmax(dim=-1), atol=0.015)


def test_seeded_rows_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    draws = 2_000
    tokens = sample(logits.expand(draws, 4), [SamplingParams(seed=11)] * draws, list(range(draws)))
    empirical = torch.bincount(tokens, minlength=4).float() / draws
    assert torch.allclose(empirical, logits.softmax(dim=-1), atol=0.05)


def test_tokens_of_zero_probability_are_never_drawn_first_middle_or_last():
    torch.manual_seed(1)
    inf = float("-inf")
    logits = torch.tensor([inf, 1.0, inf, 0.5, inf])
    draws = 20_000
    tokens = sample(logits.expand(draws, 5), [SamplingParams()] * draws)
    assert set(tokens.tolist()) == {1, 3}
    seeded = sample(logits.expand(200, 5), [SamplingParams(seed=3)] * 200, list(range(200)))
    assert set(seeded.tolist()) == {1, 3}
