"""Specification of one request's life through the public API: AsyncEngine.generate / abort.

Expected outputs are never copied from the engine: a test derives them from a first run of the
same engine (e.g. a stop string taken from the greedy text), from an independent tokenizer, or
from a checkpoint built so that the behaviour must show.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from aioengine.errors import InvalidRequestError, RequestTooLargeError
from tests.helpers import TIMEOUT, final, stream, wait_until_idle

PROMPT = "The quick brown fox"
SEEDED = {"temperature": 0.8, "top_p": 0.9, "ignore_eos": True}
LONG = 2000
"""max_tokens of a request that must be ended early: it could not finish by itself within a test."""


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)




def decoded(tokenizer: Any, token_ids: list[int]) -> str:
    """What the tokenizer alone makes of the ids it knows (the model's vocab is larger)."""
    return tokenizer.decode([t for t in token_ids if t < len(tokenizer)], skip_special_tokens=True)


def assert_text_is_the_decoded_ids(text: str, full: str) -> None:
    # A trailing byte sequence that never became a whole character is not streamed: it is the
    # only difference allowed between the streamed text and the tokenizer's own decoding.
    assert full.startswith(text) and set(full[len(text) :]) <= {"\ufffd"}, (text, full)


def assert_deltas_build_the_text(outputs: list[RequestOutput]) -> None:
    """Every delta extends what was streamed before, and the deltas add up to the final text."""
    text = outputs[-1].text
    streamed = ""
    for out in outputs:
        streamed += out.delta_text
        assert text.startswith(streamed), f"streamed {streamed!r} is not a prefix of final text {text!r}"
    assert streamed == text
    assert sum((out.delta_token_ids for out in outputs), []) == outputs[-1].token_ids


@pytest.fixture(scope="module")
def tokenizer(llama_ckpt: Path) -> Any:
    return AutoTokenizer.from_pretrained(llama_ckpt)


def edited_checkpoint(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of ``src`` whose tensors went through ``edit`` (in place)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("aioengine_checkpoint.json"))  # no longer what it says
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def eos_ckpt(llama_ckpt: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama_ckpt whose lm_head row for EOS is 1.05x the row of a token that greedy decoding of
    PROMPT produces within 4 steps: wherever that token would win with a positive logit, EOS
    wins instead, so greedy decoding of PROMPT must reach EOS within 4 tokens.

    The favoured token is found with transformers itself, not with the engine.
    """
    model = AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32)
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    favoured = ids[-1]

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"][tokenizer.eos_token_id] = tensors["lm_head.weight"][favoured] * 1.05

    return edited_checkpoint(llama_ckpt, tmp_path_factory.mktemp("eos") / "llama", edit)


@pytest.fixture(scope="module")
def undecodable_ckpt(llama_ckpt: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama_ckpt whose lm_head favours the ids the tokenizer does not have (3x their rows)."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"][len(tokenizer) :] *= 3.0

    return edited_checkpoint(llama_ckpt, tmp_path_factory.mktemp("undecodable") / "llama", edit)


# --- seeded sampling --------------------------------------------------------------------------


async def test_same_seed_gives_the_same_tokens_in_two_engine_runs(llama_ckpt, make_engine):
    params = SamplingParams(max_tokens=16, seed=1234, **SEEDED)
    runs = []
    for _ in range(2):
        async with make_engine(llama_ckpt) as engine:
            runs.append((await final(engine, PROMPT, params)).token_ids)
    assert runs[0] == runs[1]
    assert len(runs[0]) == 16


async def test_seeded_sampling_is_not_greedy(llama_engine):
    # Guards the seed tests above and below: they prove nothing if sampling collapsed to argmax.
    seeded = await final(llama_engine, PROMPT, SamplingParams(max_tokens=16, seed=1234, **SEEDED))
    argmax = await final(llama_engine, PROMPT, greedy(16))
    assert seeded.token_ids != argmax.token_ids


async def test_different_seeds_give_different_tokens(llama_engine):
    outs = [await final(llama_engine, PROMPT, SamplingParams(max_tokens=16, seed=s, **SEEDED)) for s in (1, 2, 3)]
    assert len({tuple(o.token_ids) for o in outs}) == 3


def other_requests() -> list[tuple[list[int], SamplingParams]]:
    """Eight neighbours: unseeded random, greedy and other seeds, with mixed lengths."""
    params = [
        SamplingParams(max_tokens=20, temperature=1.0),
        SamplingParams(max_tokens=5, temperature=1.2, top_k=50),
        greedy(12),
        greedy(3),
        SamplingParams(max_tokens=18, seed=1, **SEEDED),
        SamplingParams(max_tokens=9, seed=1235, temperature=0.5),
        SamplingParams(max_tokens=14, temperature=0.9, top_p=0.5),
        greedy(20),
    ]
    return [([3 + (7 * i + j) % 900 for j in range(4 + 13 * i)], p) for i, p in enumerate(params)]


async def test_seeded_tokens_do_not_depend_on_the_batch(llama_engine):
    params = SamplingParams(max_tokens=16, seed=1234, **SEEDED)
    alone = (await final(llama_engine, PROMPT, params)).token_ids

    # Submitted first, in the same step as eight neighbours' prefills.
    others = [asyncio.create_task(final(llama_engine, p, sp)) for p, sp in other_requests()]
    first = await final(llama_engine, PROMPT, params)
    await asyncio.gather(*others)

    # Submitted last, while the neighbours are already decoding.
    baseline = llama_engine.stats()["num_generated_tokens"]
    others = [asyncio.create_task(final(llama_engine, p, sp)) for p, sp in other_requests()]
    async with asyncio.timeout(30):
        while llama_engine.stats()["num_generated_tokens"] < baseline + len(others):
            await asyncio.sleep(0.005)
    joined = await final(llama_engine, PROMPT, params)
    await asyncio.gather(*others)

    assert first.token_ids == alone
    assert joined.token_ids == alone


# --- stop conditions --------------------------------------------------------------------------


def stop_string_across_a_delta_boundary(outputs: list[RequestOutput]) -> str:
    """Four clean characters around the delta boundary nearest the middle of the text."""
    boundaries, at = [], 0
    for out in outputs[:-1]:
        at += len(out.delta_text)
        boundaries.append(at)
    text = outputs[-1].text
    middle = len(text) // 2
    for b in sorted(boundaries, key=lambda b: abs(b - middle)):
        candidate = text[b - 2 : b + 2]
        if b >= 2 and len(candidate) == 4 and all(c.isprintable() and c != "\ufffd" for c in candidate):
            return candidate
    raise AssertionError(f"no clean stop string in {text!r}")


@pytest.fixture
async def stop_case(llama_engine, tokenizer) -> AsyncIterator[tuple[AsyncEngine, RequestOutput, str, int]]:
    """(engine, the greedy run without stop, a stop string from its middle, tokens until it shows)."""
    reference = await stream(llama_engine, PROMPT, greedy(24, ignore_eos=True))
    stop = stop_string_across_a_delta_boundary(reference)
    ids = reference[-1].token_ids
    needed = next(m for m in range(1, len(ids) + 1) if stop in decoded(tokenizer, ids[:m]))
    yield llama_engine, reference[-1], stop, needed


async def test_stop_string_ends_the_request_with_reason_stop(stop_case):
    engine, reference, stop, needed = stop_case
    out = await final(engine, PROMPT, greedy(24, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.token_ids == reference.token_ids[:needed], "generation stops at the token that completes it"


async def test_stop_string_is_cut_with_everything_after_it(stop_case):
    engine, reference, stop, _ = stop_case
    out = await final(engine, PROMPT, greedy(24, ignore_eos=True, stop=[stop]))
    assert out.text == reference.text[: reference.text.find(stop)]


async def test_stream_never_shows_any_part_of_the_stop_string(stop_case):
    engine, reference, stop, _ = stop_case
    outputs = await stream(engine, PROMPT, greedy(24, ignore_eos=True, stop=[stop]))
    streamed = ""
    for out in outputs:
        streamed += out.delta_text
        assert stop not in streamed
    assert streamed == outputs[-1].text == reference.text[: reference.text.find(stop)]


async def test_include_stop_str_in_output_keeps_the_stop_string(stop_case):
    engine, reference, stop, _ = stop_case
    outputs = await stream(engine, PROMPT, greedy(24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))
    assert outputs[-1].text == reference.text[: reference.text.find(stop) + len(stop)]
    assert outputs[-1].stop_reason == stop
    assert_deltas_build_the_text(outputs)


async def test_stop_token_id_ends_the_request_at_its_first_occurrence(llama_engine):
    reference = (await final(llama_engine, PROMPT, greedy(16, ignore_eos=True))).token_ids
    stop_id = reference[4]
    first = reference.index(stop_id)
    out = await final(llama_engine, PROMPT, greedy(16, ignore_eos=True, stop_token_ids=[stop_id]))
    assert out.token_ids == reference[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id


async def test_max_tokens_gives_exactly_that_many_tokens_with_reason_length(llama_engine):
    outputs = await stream(llama_engine, PROMPT, greedy(7, ignore_eos=True))
    assert len(outputs[-1].token_ids) == 7
    assert outputs[-1].finish_reason == "length"
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert_deltas_build_the_text(outputs)


async def test_eos_ends_a_request_with_reason_stop(eos_ckpt, make_engine, tokenizer):
    eos = tokenizer.eos_token_id
    async with make_engine(eos_ckpt) as engine:
        past_eos = await final(engine, PROMPT, greedy(12, ignore_eos=True))
        assert eos in past_eos.token_ids[:4], "the checkpoint was built to reach EOS within 4 tokens"
        out = await final(engine, PROMPT, greedy(12))
    assert out.token_ids == past_eos.token_ids[: past_eos.token_ids.index(eos) + 1]
    assert out.finish_reason == "stop"
    assert tokenizer.eos_token not in out.text


async def test_ignore_eos_generates_past_eos(eos_ckpt, make_engine, tokenizer):
    async with make_engine(eos_ckpt) as engine:
        out = await final(engine, PROMPT, greedy(12, ignore_eos=True))
    assert tokenizer.eos_token_id in out.token_ids[:-1]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


async def test_min_tokens_keeps_eos_out_of_the_first_tokens(eos_ckpt, make_engine, tokenizer):
    eos = tokenizer.eos_token_id
    async with make_engine(eos_ckpt) as engine:
        early = await final(engine, PROMPT, greedy(12))
        out = await final(engine, PROMPT, greedy(12, min_tokens=6))
    assert len(early.token_ids) < 6, "without min_tokens the checkpoint reaches EOS within 4 tokens"
    assert len(out.token_ids) >= 6
    assert eos not in out.token_ids[:6]


# --- abort and early exit ---------------------------------------------------------------------


async def test_abort_mid_stream_ends_the_stream_with_reason_abort(llama_engine):
    outputs = []
    async with asyncio.timeout(TIMEOUT):
        async for out in llama_engine.generate(PROMPT, greedy(LONG, ignore_eos=True), request_id="victim"):
            outputs.append(out)
            if len(outputs) == 3:
                assert await llama_engine.abort("victim") is True
    assert len(outputs) > 3, "the stream gets a last output after the abort"
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert not any(o.finished for o in outputs[:-1])
    assert len(outputs[-1].token_ids) < LONG
    await wait_until_idle(llama_engine)


async def test_abort_of_an_unknown_request_returns_false(llama_engine):
    assert await llama_engine.abort("never-submitted") is False


async def test_cancelling_the_consuming_task_frees_the_request(llama_engine):
    three = asyncio.Event()

    async def consume() -> None:
        n = 0
        async for _ in llama_engine.generate(PROMPT, greedy(LONG, ignore_eos=True)):
            n += 1
            if n == 3:
                three.set()

    task = asyncio.create_task(consume())
    async with asyncio.timeout(TIMEOUT):
        await three.wait()
    assert llama_engine.stats()["requests_running"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until_idle(llama_engine)


async def test_leaving_the_stream_early_and_closing_it_frees_the_request(llama_engine):
    agen = llama_engine.generate(PROMPT, greedy(LONG, ignore_eos=True))
    n = 0
    async for _ in agen:
        n += 1
        if n == 3:
            break
    assert llama_engine.stats()["requests_running"] == 1
    await agen.aclose()
    await wait_until_idle(llama_engine)


async def test_engine_serves_normally_after_an_abort(llama_engine):
    reference = await final(llama_engine, PROMPT, greedy(10, ignore_eos=True))
    async with asyncio.timeout(TIMEOUT):
        async for _ in llama_engine.generate(PROMPT, greedy(LONG, ignore_eos=True), request_id="gone"):
            await llama_engine.abort("gone")
    again = await final(llama_engine, PROMPT, greedy(10, ignore_eos=True), request_id="gone")
    assert again.token_ids == reference.token_ids


# --- refused at submit ------------------------------------------------------------------------


async def refused_while_another_runs(
    engine: AsyncEngine, bad: Callable[[], Any], error: type[BaseException], match: str
) -> None:
    """``bad()`` raises ``error`` at submit while a good request streams on, undisturbed."""
    reference = await final(engine, PROMPT, greedy(12, ignore_eos=True))
    outputs: list[RequestOutput] = []
    started = asyncio.Event()

    async def good() -> None:
        async for out in engine.generate(PROMPT, greedy(12, ignore_eos=True), request_id="good"):
            outputs.append(out)
            started.set()

    task = asyncio.create_task(good())
    async with asyncio.timeout(TIMEOUT):
        await started.wait()
        with pytest.raises(error, match=match):
            await bad()
        await task
    assert outputs[-1].token_ids == reference.token_ids and outputs[-1].finish_reason == "length"
    await wait_until_idle(engine)


@pytest.mark.parametrize("prompt", ["", []], ids=["empty-str", "empty-list"])
async def test_empty_prompt_is_refused(llama_engine, prompt):
    await refused_while_another_runs(
        llama_engine, lambda: final(llama_engine, prompt, greedy(4)), InvalidRequestError, "prompt is empty"
    )


@pytest.mark.parametrize("bad_id", [-1, "vocab"], ids=["negative", "vocab-size"])
async def test_token_id_outside_the_vocabulary_is_refused(llama_engine, bad_id):
    vocab = llama_engine.model_info["vocab_size"]
    bad_id = vocab if bad_id == "vocab" else bad_id
    await refused_while_another_runs(
        llama_engine,
        lambda: final(llama_engine, [5, bad_id, 6], greedy(4)),
        InvalidRequestError,
        rf"token id {bad_id} is outside the vocabulary \[0, {vocab}\)",
    )


async def test_prompt_plus_max_tokens_over_max_model_len_is_refused(llama_ckpt, make_engine):
    async with make_engine(llama_ckpt, model={"max_model_len": 64}) as engine:
        await refused_while_another_runs(
            engine,
            lambda: final(engine, list(range(10, 50)), greedy(25)),
            RequestTooLargeError,
            "= 65 exceeds max_model_len=64",
        )


async def test_a_request_of_exactly_max_model_len_is_served(llama_ckpt, make_engine):
    async with make_engine(llama_ckpt, model={"max_model_len": 64}) as engine:
        out = await final(engine, list(range(10, 50)), greedy(24, ignore_eos=True))
    assert len(out.token_ids) == 24 and out.finish_reason == "length"


async def test_a_request_larger_than_the_whole_kv_cache_is_refused(llama_ckpt, make_engine):
    async with make_engine(llama_ckpt, cache={"num_blocks": 4, "block_size": 16}) as engine:
        await refused_while_another_runs(
            engine,
            lambda: final(engine, list(range(10, 20)), greedy(60)),
            RequestTooLargeError,
            r"needs 70 tokens of KV cache but the whole cache holds \d+",
        )


async def test_a_request_id_already_in_flight_is_refused(llama_engine):
    # The good request of the helper is in flight as "good"; reusing the id must not touch it.
    await refused_while_another_runs(
        llama_engine,
        lambda: final(llama_engine, PROMPT, greedy(4), request_id="good"),
        InvalidRequestError,
        "'good' is already in flight",
    )


@pytest.mark.parametrize(
    ("params", "field"),
    [({"temperature": -1.0}, "temperature"), ({"max_tokens": 0}, "max_tokens"), ({"bogus": 1}, "bogus")],
)
async def test_bad_sampling_params_are_refused_naming_the_field(llama_engine, params, field):
    await refused_while_another_runs(
        llama_engine, lambda: final(llama_engine, PROMPT, params), ValidationError, field
    )


# --- text -------------------------------------------------------------------------------------


async def test_undecodable_prompt_ids_stream_valid_text(llama_engine, tokenizer):
    prompt = list(range(len(tokenizer), llama_engine.model_info["vocab_size"]))[:24]
    assert prompt, "the test model's vocab must be larger than the tokenizer's"
    params = SamplingParams(temperature=1.5, seed=7, max_tokens=48, ignore_eos=True)
    outputs = await stream(llama_engine, prompt, params)
    assert all(isinstance(o.text, str) and isinstance(o.delta_text, str) for o in outputs)
    assert_deltas_build_the_text(outputs)
    assert_text_is_the_decoded_ids(outputs[-1].text, decoded(tokenizer, outputs[-1].token_ids))


async def test_generated_undecodable_ids_are_left_out_of_the_text(undecodable_ckpt, make_engine, tokenizer):
    async with make_engine(undecodable_ckpt) as engine:
        outputs = await stream(engine, PROMPT, SamplingParams(temperature=1.0, seed=7, max_tokens=32, ignore_eos=True))
    ids = outputs[-1].token_ids
    assert sum(t >= len(tokenizer) for t in ids) >= 8, "the checkpoint favours ids the tokenizer lacks"
    assert any(t < len(tokenizer) for t in ids)
    assert_deltas_build_the_text(outputs)
    assert_text_is_the_decoded_ids(outputs[-1].text, decoded(tokenizer, ids))


SCRIPTS = [
    "日本語のテキストと漢字",
    "Привет, как дела?",
    "emoji 🤖🚀🎉 and",
    "naïve café, crème brûlée",
    "中文文本：你好，世界！",
]


def split_characters(tokenizer: Any, token_ids: list[int]) -> int:
    """How many non-ASCII characters were completed by a token after the one that began them."""
    ids = [t for t in token_ids if t < len(tokenizer)]
    count = 0
    for i in range(len(ids) - 1):
        before, after = tokenizer.decode(ids[: i + 1]), tokenizer.decode(ids[: i + 2])
        if before.endswith("\ufffd") and len(after) >= len(before) and ord(after[len(before) - 1]) > 127:
            count += after[len(before) - 1] != "\ufffd"
    return count


async def test_streamed_text_never_breaks_a_multibyte_character(llama_engine, tokenizer):
    # A character whose bytes span two tokens must be held back until it is whole: were half of
    # it streamed as "\ufffd", the streamed text would stop being a prefix of the decoded ids.
    runs = await asyncio.gather(
        *(stream(llama_engine, p, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=32, ignore_eos=True))
          for i, p in enumerate(SCRIPTS))  # fmt: skip
    )
    for outputs in runs:
        assert_deltas_build_the_text(outputs)
        assert_text_is_the_decoded_ids(outputs[-1].text, decoded(tokenizer, outputs[-1].token_ids))
    assert sum(split_characters(tokenizer, o[-1].token_ids) for o in runs) >= 1, (
        "no character was split across tokens: the test would not exercise the hold-back"
    )


async def test_string_prompt_is_tokenized_and_reported(llama_engine, tokenizer):
    out = await final(llama_engine, PROMPT, greedy(6))
    assert out.prompt_token_ids == tokenizer(PROMPT).input_ids
    assert tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True) == PROMPT


async def test_string_prompt_generates_like_its_token_ids(llama_engine, tokenizer):
    by_text = await final(llama_engine, PROMPT, greedy(8, ignore_eos=True))
    by_ids = await final(llama_engine, tokenizer(PROMPT).input_ids, greedy(8, ignore_eos=True))
    assert by_text.token_ids == by_ids.token_ids
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids
