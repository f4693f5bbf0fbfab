"""Specification of the sampler's logit controls: each one, the order they combine in, and greedy rows under them.

Each control is checked against a reference written in plain Python from its definition (OpenAI, vLLM,
HF transformers) on one hand-picked row of 12 logits. How the sampler treats a batch's rows, seeded samples
and ``gather_logprobs`` are specified in test_sampling_batches.py, which uses the references and ``run`` here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from aioengine.sampling.params import SamplingParams
from aioengine.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata
from tests.helpers import hf_generate

V = 12
ROW = [2.0, -1.0, 0.5, 3.0, -2.5, 0.0, 1.5, -0.5, 2.75, -3.0, 1.0, 0.25]
"""Distinct values, negatives included; the argmax is 3, then 8."""
INF = float("inf")
GREEDY = {"temperature": 0}

sampler = Sampler()


def run(
    params: Sequence[SamplingParams],
    logits: torch.Tensor | None = None,
    *,
    histories: Sequence[tuple[list[int], int] | None] | None = None,
    banned: Sequence[list[int] | None] | None = None,
    output_indices: Sequence[int] | None = None,
    sample_indices: Sequence[int] | None = None,
    processed: bool = True,
) -> SamplerOutput:
    if logits is None:
        logits = torch.tensor([ROW] * len(params))
    meta = SamplingMetadata.build(
        params,
        output_indices if output_indices is not None else [0] * len(params),
        "cpu",
        vocab_size=logits.shape[-1],
        sample_indices=sample_indices,
        histories=histories,
        banned=banned,
        processed=processed,
    )
    return sampler(logits, meta)


def processed_row(params: SamplingParams, history: tuple[list[int], int] | None = None, **kwargs) -> list[float]:
    out = run([params], histories=[history] if history is not None else None, **kwargs)
    assert out.processed_logits is not None
    return out.processed_logits[0].tolist()


def assert_rows_close(actual: Sequence[float], expected: Sequence[float]) -> None:
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected, dtype=torch.float32))


# --- references, from the definitions -------------------------------------------------------------


def ref_allowed(row: list[float], allowed: list[int]) -> list[float]:
    return [x if t in allowed else -INF for t, x in enumerate(row)]


def ref_bad_words(row: list[float], bad_words: list[list[int]], output: list[int]) -> list[float]:
    """vLLM: ban a sequence's last token when the output ends with the rest of it."""
    banned = {
        seq[-1] for seq in bad_words if len(seq) - 1 <= len(output) and output[len(output) - len(seq) + 1 :] == seq[:-1]
    }
    return [-INF if t in banned else x for t, x in enumerate(row)]


def ref_banned(row: list[float], banned: list[int]) -> list[float]:
    return [-INF if t in banned else x for t, x in enumerate(row)]


def ref_logit_bias(row: list[float], bias: dict[int, float]) -> list[float]:
    return [x + bias.get(t, 0.0) for t, x in enumerate(row)]


def ref_repetition(row: list[float], tokens: list[int], penalty: float) -> list[float]:
    """HF / CTRL: a seen token's logit is divided by the penalty when positive, else multiplied."""
    return [(x / penalty if x > 0 else x * penalty) if t in tokens else x for t, x in enumerate(row)]


def ref_presence_frequency(row: list[float], output: list[int], presence: float, frequency: float) -> list[float]:
    """OpenAI: logit - frequency * count - presence * (count > 0), over the output."""
    return [x - frequency * output.count(t) - presence * (output.count(t) > 0) for t, x in enumerate(row)]


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    return [e / sum(exps) for e in exps]


def ref_min_p(row: list[float], min_p: float) -> list[float]:
    probs = softmax(row)
    return [x if p >= min_p * max(probs) else -INF for x, p in zip(row, probs, strict=True)]


def ref_top_k(row: list[float], k: int) -> list[float]:
    kth = sorted(row, reverse=True)[k - 1]
    return [x if x >= kth else -INF for x in row]


def ref_top_p(row: list[float], top_p: float) -> list[float]:
    """Keep the tokens the mass strictly above which is < top_p (the fewest whose mass reaches top_p)."""
    probs = softmax(row)
    return [x if sum(q for q in probs if q > p) < top_p else -INF for x, p in zip(row, probs, strict=True)]


def ref_processed(p: SamplingParams, prompt: list[int], output: list[int], banned: list[int]) -> list[float]:
    """Every control in vLLM v1's order."""
    row = list(ROW)
    if p.allowed_token_ids is not None:
        row = ref_allowed(row, p.allowed_token_ids)
    row = ref_bad_words(row, p.bad_words_token_ids, output)
    row = ref_banned(row, banned)
    row = ref_logit_bias(row, p.logit_bias or {})
    row = ref_repetition(row, prompt + output, p.repetition_penalty)
    row = ref_presence_frequency(row, output, p.presence_penalty, p.frequency_penalty)
    if p.is_greedy:
        return row
    row = [x / p.temperature for x in row]
    row = ref_min_p(row, p.min_p)
    if p.top_k:
        row = ref_top_k(row, p.top_k)
    return ref_top_p(row, p.top_p)


def argmax(row: Sequence[float]) -> int:
    return max(range(len(row)), key=lambda t: (row[t], -t))


# --- each control against its reference ------------------------------------------------------------


def test_repetition_penalty_matches_hf_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt, output = [3, 1, 5], [8, 4, 8]
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), torch.tensor([ROW]))
    mine = processed_row(SamplingParams(repetition_penalty=1.7, **GREEDY), (prompt + output, len(prompt)))
    assert mine == hf[0].tolist()
    assert_rows_close(mine, ref_repetition(ROW, prompt + output, 1.7))


def test_repetition_penalty_below_one_rewards_seen_tokens():
    prompt, output = [1, 2], [9]
    mine = processed_row(SamplingParams(repetition_penalty=0.5, **GREEDY), (prompt + output, len(prompt)))
    assert_rows_close(mine, ref_repetition(ROW, prompt + output, 0.5))


def test_presence_and_frequency_penalties_count_output_tokens_only():
    prompt, output = [3, 6, 6], [8, 8, 8, 1, 10]
    params = SamplingParams(presence_penalty=0.75, frequency_penalty=0.5, **GREEDY)
    mine = processed_row(params, (prompt + output, len(prompt)))
    assert_rows_close(mine, ref_presence_frequency(ROW, output, 0.75, 0.5))
    assert mine[3] == ROW[3] and mine[6] == ROW[6]  # prompt-only tokens keep their logits


def test_negative_presence_and_frequency_penalties_reward_output_tokens():
    prompt, output = [0], [4, 4]
    params = SamplingParams(presence_penalty=-1.0, frequency_penalty=-2.0, **GREEDY)
    assert_rows_close(
        processed_row(params, (prompt + output, len(prompt))), ref_presence_frequency(ROW, output, -1, -2)
    )


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability_after_temperature():
    params = SamplingParams(temperature=0.8, min_p=0.1)
    expected = ref_min_p([x / 0.8 for x in ROW], 0.1)
    mine = processed_row(params)
    assert_rows_close(mine, expected)
    assert 0 < sum(x == -INF for x in expected) < V - 2  # the case is not trivial
    torch.manual_seed(0)
    tokens = run([params] * 2000, processed=False).token_ids.tolist()
    assert set(tokens) == {t for t, x in enumerate(expected) if x > -INF}


def test_min_p_one_keeps_only_the_top_token():
    tokens = run([SamplingParams(temperature=5.0, min_p=1.0)] * 200).token_ids
    assert set(tokens.tolist()) == {3}


def test_logit_bias_is_added_to_the_logits():
    bias = {0: -1.5, 4: 2.0, 11: 100.0}
    mine = processed_row(SamplingParams(logit_bias=bias, **GREEDY))
    assert_rows_close(mine, ref_logit_bias(ROW, bias))
    assert run([SamplingParams(logit_bias=bias, **GREEDY)]).token_ids.tolist() == [11]


def test_allowed_token_ids_mask_every_other_token():
    allowed = [1, 4, 7]
    assert processed_row(SamplingParams(allowed_token_ids=allowed, **GREEDY)) == ref_allowed(ROW, allowed)
    torch.manual_seed(0)
    tokens = run([SamplingParams(temperature=3.0, allowed_token_ids=allowed)] * 500).token_ids
    assert set(tokens.tolist()) == set(allowed)


def test_single_token_bad_word_is_always_banned():
    params = SamplingParams(bad_words_token_ids=[[3]], **GREEDY)
    for history in ([5], [5, 3, 8]):  # no output yet; any output
        mine = processed_row(params, (history, 1))
        assert mine == ref_bad_words(ROW, [[3]], history[1:])
        assert mine[3] == -INF
        assert argmax(mine) == 8


def test_multi_token_bad_word_bans_its_last_token_only_after_its_prefix():
    params = SamplingParams(bad_words_token_ids=[[6, 7, 3]], **GREEDY)
    prompt = [1, 6, 7]
    cases = {
        (6, 7): True,  # the output ends with the prefix
        (1, 6, 7): True,
        (6, 7, 2): False,  # the prefix is not at the end
        (7,): False,  # only part of the prefix
        (): False,  # the prefix sits in the prompt only: vLLM looks at the output
    }
    for output, is_banned in cases.items():
        mine = processed_row(params, (prompt + list(output), len(prompt)))
        assert mine == ref_bad_words(ROW, [[6, 7, 3]], list(output))
        assert (mine[3] == -INF) is is_banned, output


def test_banned_ids_are_never_picked():
    mine = processed_row(SamplingParams(**GREEDY), banned=[[3, 8]])
    assert mine == ref_banned(ROW, [3, 8])
    assert run([SamplingParams(**GREEDY)], banned=[[3, 8]]).token_ids.tolist() == [0]
    torch.manual_seed(0)
    tokens = run([SamplingParams(temperature=2.0)] * 1000, banned=[[3, 8, 0]] * 1000).token_ids.tolist()
    assert not {3, 8, 0} & set(tokens)


# --- order, greedy rows ------------------------------------------------------------------------------


def test_controls_combine_in_the_documented_order():
    prompt, output = [2, 5], [6, 7, 2, 6]
    params = SamplingParams(
        temperature=2.0,
        top_k=5,
        top_p=0.75,
        min_p=0.05,
        allowed_token_ids=[0, 1, 2, 3, 5, 6, 7, 8, 10, 11],
        bad_words_token_ids=[[7, 2, 6, 8], [1]],
        logit_bias={2: -2.0, 5: 1.5, 1: 50.0, 10: 0.5},
        repetition_penalty=2.0,
        presence_penalty=0.4,
        frequency_penalty=0.3,
    )
    expected = ref_processed(params, prompt, output, banned=[0])
    mine = processed_row(params, (prompt + output, len(prompt)), banned=[[0]])
    assert_rows_close(mine, expected)
    # Left after the penalties: 3, 10, 5, 11, 6, 7, 2; min-p drops 2, top-k 7, top-p 11 and 6.
    assert {t for t, x in enumerate(mine) if x > -INF} == {3, 10, 5}


def test_logit_bias_comes_before_the_penalties():
    params = SamplingParams(logit_bias={2: -2.0}, repetition_penalty=2.0, presence_penalty=0.4, **GREEDY)
    mine = processed_row(params, ([2], 0))
    assert_rows_close([mine[2]], [(0.5 - 2.0) * 2.0 - 0.4])  # not 0.5 / 2 - 2 - 0.4


def test_greedy_rows_honour_the_controls_and_ignore_temperature_min_p_top_k_top_p():
    prompt, output = [3], [8, 10]
    params = SamplingParams(
        temperature=0, top_k=1, top_p=0.1, min_p=0.9, logit_bias={4: 1.0}, repetition_penalty=1.6, presence_penalty=1
    )
    expected = ref_processed(params, prompt, output, banned=[])
    out = run([params], histories=[(prompt + output, len(prompt))])
    assert out.processed_logits is not None
    assert_rows_close(out.processed_logits[0].tolist(), expected)
    assert out.token_ids.tolist() == [argmax(expected)] and argmax(expected) != 3
    assert sum(x == -INF for x in out.processed_logits[0].tolist()) == 0


def _toy_logits(ids: list[int]) -> torch.Tensor:
    """A fixed "model" that likes to repeat its last token: repetition penalties change its greedy path."""
    base = torch.randn(V, generator=torch.Generator().manual_seed(len(ids)))
    return base + 4.0 * torch.nn.functional.one_hot(torch.tensor(ids[-1]), V)


def test_greedy_with_repetition_penalty_follows_hf_step_by_step():
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt = [3, 5, 3]

    def decode(penalty: float, hf: bool) -> list[int]:
        ids = list(prompt)
        for _ in range(10):
            logits = _toy_logits(ids)[None]
            if hf:
                token = int(RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits).argmax())
            else:
                params = SamplingParams(temperature=0, repetition_penalty=penalty)
                token = int(run([params], logits, histories=[(ids, len(prompt))], processed=False).token_ids[0])
            ids.append(token)
        return ids[len(prompt) :]

    assert decode(1.8, hf=False) == decode(1.8, hf=True)
    assert decode(1.8, hf=False) != decode(1.0, hf=False)


def test_greedy_with_repetition_penalty_equals_hf_generate(llama_ckpt: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32).eval()
    prompt, new_tokens, penalty = [5, 17, 5, 300, 17, 42], 16, 1.3
    hf = hf_generate(model, [prompt], new_tokens, repetition_penalty=penalty)[0]

    @torch.inference_mode()
    def decode(repetition_penalty: float) -> list[int]:
        out: list[int] = []
        for _ in range(new_tokens):
            seq = prompt + out
            logits = model(torch.tensor([seq])).logits[:, -1].float()
            params = SamplingParams(temperature=0, repetition_penalty=repetition_penalty)
            out.append(int(run([params], logits, histories=[(seq, len(prompt))], processed=False).token_ids[0]))
        return out

    assert decode(penalty) == hf
    assert decode(1.0) != hf  # the penalty changed the path
