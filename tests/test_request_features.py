"""What RL rollouts and servers ask of a request, end to end on the engine, checked against HF transformers
on the same checkpoint (float32): n samples, logprobs, prompt logprobs, scoring, penalties and logit
controls, and the checks at submit."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from aioengine.errors import InvalidRequestError
from tests.helpers import TIMEOUT, final, hf_generate, last_output, stream, wait_until_idle

PROMPT = [5, 17, 230, 41, 8, 99, 310, 12, 64, 7, 150, 23, 400, 18, 3, 77, 51, 260, 9, 33, 88, 140]
"""22 tokens: the shared prefix (21) fills one block of 16 and part of the next."""
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(llama_ckpt: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32).eval()


def hf_log_softmax(model: Any, token_ids: list[int]) -> torch.Tensor:
    """[len, V]: row i is HF's log-softmax of the logits after ``token_ids[: i + 1]``."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def assert_entry_matches(entry: dict[int, Any], token: int, reference: torch.Tensor, k: int) -> None:
    """One position's logprobs: the chosen token's value and rank, then the top k, against ``reference`` [V]."""
    assert token in entry
    assert abs(entry[token].logprob - reference[token].item()) < TOL
    assert entry[token].rank == int((reference >= reference[token]).sum())
    top = reference.topk(k)
    others = {t: lp for t, lp in entry.items() if t != token}
    for rank, (value, t) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), start=1):
        if t == token:
            continue
        assert t in others, f"top-{rank} token {t} missing"
        assert abs(others[t].logprob - value) < TOL and others[t].rank == rank
    assert len(entry) in (k, k + 1)


async def collect_all(engine: AsyncEngine, prompt: Any, params: SamplingParams) -> list[RequestOutput]:
    return await stream(engine, prompt, params)


# --- logprobs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=10, logprobs=5, ignore_eos=True),
    ],
    ids=["greedy", "sampled"],
)
async def test_each_generated_tokens_logprobs_equal_hf_log_softmax(
    llama_engine: AsyncEngine, hf_model: Any, params: SamplingParams
) -> None:
    out = await final(llama_engine, PROMPT, params)
    tokens = out.token_ids
    assert out.logprobs is not None and len(out.logprobs) == len(tokens) == 10
    reference = hf_log_softmax(hf_model, PROMPT + tokens)
    for j, (entry, token) in enumerate(zip(out.logprobs, tokens, strict=True)):
        assert_entry_matches(entry, token, reference[len(PROMPT) - 1 + j], 5)
    total = sum(reference[len(PROMPT) - 1 + j, t].item() for j, t in enumerate(tokens))
    assert out.cumulative_logprob is not None and abs(out.cumulative_logprob - total) < 10 * TOL


async def test_prompt_logprobs_equal_hf_and_the_first_position_has_none(
    make_engine: Callable[..., AsyncEngine], llama_ckpt: Path, hf_model: Any
) -> None:
    # a small step budget: the prompt comes in chunks, whose boundaries need the next chunk's first token
    async with make_engine(llama_ckpt, scheduler={"max_num_batched_tokens": 8}) as engine:
        out = await final(engine, PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    reference = hf_log_softmax(hf_model, PROMPT)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[i]
        assert entry is not None
        assert_entry_matches(entry, PROMPT[i], reference[i - 1], 3)


async def test_processed_logprobs_are_the_log_softmax_of_the_logits_sampled_from(
    llama_engine: AsyncEngine, hf_model: Any
) -> None:
    temperature, top_k = 0.7, 6
    params = SamplingParams(
        temperature=temperature, top_k=top_k, seed=11, max_tokens=6, logprobs=top_k, logprobs_mode="processed"
    )
    out = await final(llama_engine, PROMPT, params)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([PROMPT + out.token_ids])).logits[0].float()
    assert out.logprobs is not None
    for j, (entry, token) in enumerate(zip(out.logprobs, out.token_ids, strict=True)):
        row = logits[len(PROMPT) - 1 + j] / temperature
        kth = row.topk(top_k).values[-1]
        processed = row.masked_fill(row < kth, float("-inf")).log_softmax(dim=-1)
        assert_entry_matches(entry, token, processed, top_k)
        assert abs(sum(math.exp(lp.logprob) for lp in entry.values()) - 1.0) < TOL, "top-k hold all the mass"


async def test_a_request_without_logprobs_gets_none(llama_engine: AsyncEngine) -> None:
    out = await final(llama_engine, PROMPT, SamplingParams(temperature=0, max_tokens=3))
    assert out.logprobs is None and out.cumulative_logprob is None and out.prompt_logprobs is None


# --- scoring -------------------------------------------------------------------------------------------------------


async def test_score_equals_the_sum_of_hf_token_logprobs(llama_engine: AsyncEngine, hf_model: Any) -> None:
    continuations = [[44, 45, 46], [300], [7, 7, 7, 7, 7, 9, 12, 500, 501, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    scores = await asyncio.wait_for(llama_engine.score(PROMPT, continuations, top_logprobs=2), TIMEOUT)
    assert [s.token_ids for s in scores] == continuations
    for continuation, score in zip(continuations, scores, strict=True):
        reference = hf_log_softmax(hf_model, PROMPT + continuation)
        expected = [reference[len(PROMPT) - 1 + j, t].item() for j, t in enumerate(continuation)]
        assert max(abs(a - b) for a, b in zip(score.logprobs, expected, strict=True)) < TOL
        assert abs(score.total - sum(expected)) < 10 * TOL
        for j, entry in enumerate(score.top_logprobs):
            assert_entry_matches(entry, continuation[j], reference[len(PROMPT) - 1 + j], 2)
    stats = await wait_until_idle(llama_engine)
    assert stats.num_generated_tokens == 0, "a score generates nothing"


async def test_score_refuses_bad_input_and_the_engine_keeps_serving(llama_engine: AsyncEngine) -> None:
    with pytest.raises(InvalidRequestError, match="continuations must be a non-empty list"):
        await llama_engine.score(PROMPT, [])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        await llama_engine.score(PROMPT, [[10**9]])
    with pytest.raises(InvalidRequestError, match="continuation 1 is empty"):
        await llama_engine.score(PROMPT, [[5], []])
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        await llama_engine.score(PROMPT, [[5]], top_logprobs=21)
    assert len((await final(llama_engine, PROMPT, SamplingParams(temperature=0, max_tokens=2))).token_ids) == 2


# --- n samples -----------------------------------------------------------------------------------------------------


async def test_n_greedy_samples_are_identical_and_equal_hf(llama_engine: AsyncEngine, hf_model: Any) -> None:
    out = await final(llama_engine, PROMPT, SamplingParams(n=8, temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.index for o in out.outputs] == list(range(8))
    expected = hf_generate(hf_model, [PROMPT], 12)[0]
    assert all(o.token_ids == expected for o in out.outputs)
    assert out.token_ids == expected, "the flat fields are sample 0's"


async def test_n_samples_hold_the_prompt_blocks_once(llama_engine: AsyncEngine) -> None:
    """22 prompt tokens: the shared 21 fill block 0 and part of block 1; 5 new tokens stay in block 1. So 8
    samples hold 1 + 8 blocks (8 separate requests would hold 16)."""
    used = []
    params = SamplingParams(n=8, temperature=1.0, seed=0, max_tokens=5, ignore_eos=True)
    async for out in llama_engine.generate(PROMPT, params):
        if not out.finished and all(o.token_ids for o in out.outputs):
            stats = llama_engine.stats()
            used.append(stats.kv_blocks_total - stats.kv_blocks_free)
    assert max(used) == 1 + 8  # (fewer once the first sample, which started a step earlier, finished)


async def test_seeded_samples_are_reproducible_and_independent_of_the_batch(llama_engine: AsyncEngine) -> None:
    params = SamplingParams(n=6, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = await final(llama_engine, PROMPT, params)
    others = [
        asyncio.create_task(final(llama_engine, PROMPT[i:], SamplingParams(temperature=1.0, max_tokens=20)))
        for i in range(6)
    ]
    crowded = await final(llama_engine, PROMPT, params)
    await asyncio.gather(*others)
    assert [o.token_ids for o in crowded.outputs] == [o.token_ids for o in alone.outputs]
    assert len({tuple(o.token_ids) for o in alone.outputs}) == 6, "each sample draws from its own (seed, index)"
    single = await final(llama_engine, PROMPT, params.model_copy(update={"n": 1}))
    assert single.token_ids == alone.outputs[0].token_ids, "sample 0 of n is the n == 1 request"


async def test_n_samples_survive_preemption_unchanged(
    make_engine: Callable[..., AsyncEngine], llama_ckpt: Path, hf_model: Any
) -> None:
    seeded = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(n=4, temperature=0, max_tokens=40, ignore_eos=True)
    async with make_engine(llama_ckpt) as roomy:
        expected = await final(roomy, PROMPT, seeded)
    async with make_engine(llama_ckpt, cache={"num_blocks": 12}) as tight:
        outs = await asyncio.gather(final(tight, PROMPT, seeded), final(tight, PROMPT, greedy))
        assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in outs[0].outputs] == [o.token_ids for o in expected.outputs]
    reference = hf_generate(hf_model, [PROMPT], 40)[0]
    assert all(o.token_ids == reference for o in outs[1].outputs)


async def test_each_sample_finishes_on_its_own(llama_engine: AsyncEngine) -> None:
    stop_ids = list(range(0, 1024, 3))  # a third of the vocabulary: samples stop after different lengths
    params = SamplingParams(n=6, temperature=1.0, seed=2, max_tokens=60, stop_token_ids=stop_ids)
    outputs = await collect_all(llama_engine, PROMPT, params)
    last = outputs[-1]
    assert len({len(o.token_ids) for o in last.outputs}) > 1
    partly = [out for out in outputs if any(o.finished for o in out.outputs) and not out.finished]
    assert partly, "some output shows a finished sample beside running ones"
    for out in partly:
        for o in out.outputs:
            if o.finished:
                assert o.token_ids == last.outputs[o.index].token_ids, "a finished sample no longer changes"
    for o in last.outputs:
        assert o.finish_reason in ("stop", "length")
        if o.finish_reason == "stop":
            assert o.stop_reason in stop_ids and o.token_ids[-1] == o.stop_reason
    for o in last.outputs:
        streamed = [t for out in outputs for t in out.outputs[o.index].delta_token_ids]
        assert streamed == o.token_ids, "deltas of each sample build its tokens"


async def test_cancelling_a_stream_of_n_samples_frees_every_sample(llama_engine: AsyncEngine) -> None:
    params = SamplingParams(n=5, temperature=1.0, max_tokens=2000, ignore_eos=True)
    agen = llama_engine.generate(PROMPT, params, request_id="many")
    first = await agen.__anext__()
    assert len(first.outputs) == 5
    await agen.aclose()
    await wait_until_idle(llama_engine)
    assert await llama_engine.abort("many") is False


async def test_aborting_a_request_of_n_samples_ends_them_all(llama_engine: AsyncEngine) -> None:
    params = SamplingParams(n=4, temperature=1.0, max_tokens=2000, ignore_eos=True)
    seen = asyncio.Event()
    outputs: list[RequestOutput] = []

    async def consume() -> None:
        async for out in llama_engine.generate(PROMPT, params, request_id="abort-me"):
            outputs.append(out)
            seen.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(seen.wait(), TIMEOUT)
    assert await llama_engine.abort("abort-me")
    await asyncio.wait_for(task, TIMEOUT)
    assert outputs[-1].finished and {o.finish_reason for o in outputs[-1].outputs} == {"abort"}
    await wait_until_idle(llama_engine)


# --- penalties and logit controls ------------------------------------------------------------------------------


def reference_greedy(
    model: Any, prompt: list[int], steps: int, process: Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]
) -> list[int]:
    """Greedy decoding with HF's logits, ``process(logits, prompt, output)`` applied before each argmax."""
    output: list[int] = []
    for _ in range(steps):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        output.append(int(process(logits.clone(), prompt, output).argmax()))
    return output


def counts(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=vocab).float()


async def test_repetition_penalty_gives_hfs_greedy_tokens(llama_engine: AsyncEngine, hf_model: Any) -> None:
    expected = hf_generate(hf_model, [PROMPT], 24, repetition_penalty=1.3)[0]
    out = await final(llama_engine, PROMPT, SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3))
    plain = await final(llama_engine, PROMPT, SamplingParams(temperature=0, max_tokens=24))
    assert out.token_ids == expected
    assert out.token_ids != plain.token_ids, "the penalty changes this model's greedy tokens"


@pytest.mark.parametrize(
    ("fields", "process"),
    [
        (
            {"presence_penalty": 1.5},
            lambda logits, prompt, output: logits - 1.5 * (counts(output, logits.numel()) > 0).float(),
        ),
        (
            {"frequency_penalty": 0.8},
            lambda logits, prompt, output: logits - 0.8 * counts(output, logits.numel()),
        ),
        (
            {"frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {33: 3.0, 140: -100.0}},
            lambda logits, prompt, output: (
                logits
                + torch.zeros_like(logits).index_put_((torch.tensor([33, 140]),), torch.tensor([3.0, -100.0]))
                - 0.5 * counts(output, logits.numel())
                - 0.5 * (counts(output, logits.numel()) > 0).float()
            ),
        ),
    ],
    ids=["presence", "frequency", "bias+both"],
)
async def test_openai_penalties_and_logit_bias_match_their_definitions(
    llama_engine: AsyncEngine, hf_model: Any, fields: dict[str, Any], process: Any
) -> None:
    expected = reference_greedy(hf_model, PROMPT, 16, process)
    out = await final(llama_engine, PROMPT, SamplingParams(temperature=0, max_tokens=16, **fields))
    assert out.token_ids == expected


async def test_allowed_token_ids_and_a_large_bias_confine_the_output(llama_engine: AsyncEngine) -> None:
    allowed = [40, 41, 42]
    out = await final(llama_engine, PROMPT, SamplingParams(temperature=1.0, max_tokens=30, allowed_token_ids=allowed))
    assert set(out.token_ids) <= set(allowed)
    out = await final(llama_engine, PROMPT, SamplingParams(temperature=0, max_tokens=10, logit_bias={77: 100.0}))
    assert out.token_ids == [77] * 10


async def test_bad_words_are_never_completed(llama_engine: AsyncEngine) -> None:
    plain = (await final(llama_engine, PROMPT, SamplingParams(temperature=0, max_tokens=20))).token_ids
    first, pair = plain[0], plain[3:5]
    out = await final(
        llama_engine, PROMPT, SamplingParams(temperature=0, max_tokens=20, bad_words_token_ids=[[first], pair])
    )
    assert first not in out.token_ids
    assert all(out.token_ids[i : i + 2] != pair for i in range(len(out.token_ids) - 1))
    assert out.token_ids != plain


async def test_bad_word_strings_are_banned_as_tokenized(llama_engine: AsyncEngine, tokenizer: Any) -> None:
    prompt = "The quick brown fox"
    plain = (await final(llama_engine, prompt, SamplingParams(temperature=0, max_tokens=12))).token_ids
    # a generated token that is a word of its own, whether or not a space leads it
    token = next(t for t in plain if t < len(tokenizer) and tokenizer.decode([t]).strip().isalpha())
    word = tokenizer.decode([token]).strip()
    out = await final(llama_engine, prompt, SamplingParams(temperature=0, max_tokens=12, bad_words=[word]))
    assert token not in out.token_ids  # (the word spelled by other tokens is not banned, as in vLLM)


async def test_min_p_keeps_only_tokens_near_the_most_likely(llama_engine: AsyncEngine, hf_model: Any) -> None:
    min_p = 0.3
    out = await final(llama_engine, PROMPT, SamplingParams(temperature=1.0, min_p=min_p, seed=9, max_tokens=20))
    probs = hf_log_softmax(hf_model, PROMPT + out.token_ids).exp()
    for j, token in enumerate(out.token_ids):
        row = probs[len(PROMPT) - 1 + j]
        assert row[token] >= min_p * row.max() - 1e-6


# --- checks at submit ------------------------------------------------------------------------------------------


def bad_params() -> Iterator[tuple[dict[str, Any], str]]:
    yield {"n": 0}, "n must be >= 1"
    yield {"n": 65}, "max_num_seqs"
    yield {"logprobs": 21}, "max_logprobs"
    yield {"prompt_logprobs": -1}, "prompt_logprobs"
    yield {"logprobs_mode": "logits"}, "logprobs_mode"
    yield {"repetition_penalty": 0.0}, "repetition_penalty"
    yield {"presence_penalty": 2.5}, "presence_penalty"
    yield {"frequency_penalty": -3}, "frequency_penalty"
    yield {"min_p": 1.5}, "min_p"
    yield {"logit_bias": {5: 101.0}}, "logit_bias"
    yield {"logit_bias": {10**6: 1.0}}, "outside the vocabulary"
    yield {"allowed_token_ids": []}, "allowed_token_ids"
    yield {"allowed_token_ids": [10**6]}, "outside the vocabulary"
    yield {"bad_words_token_ids": [[]]}, "bad_words_token_ids"
    yield {"bad_words": [" "]}, "bad_words"


@pytest.mark.parametrize(("fields", "message"), list(bad_params()), ids=lambda v: str(v)[:30])
async def test_every_new_field_is_checked_at_submit_by_name(
    llama_engine: AsyncEngine, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await final(llama_engine, PROMPT, {"max_tokens": 2, **fields})
    assert len((await last_output(llama_engine.generate(PROMPT, {"max_tokens": 2}))).token_ids) == 2
