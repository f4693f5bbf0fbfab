"""Specification of what a request may be: refusals at submit (the engine keeps serving the others),
undecodable ids, multi-byte characters and string prompts in the streamed text."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from aioengine.engine.outputs import IncrementalDetokenizer
from aioengine.errors import InvalidRequestError, RequestTooLargeError
from tests.engine_request_support import (
    PROMPT,
    assert_deltas_build_the_text,
    assert_text_is_the_decoded_ids,
    decoded,
    greedy,
)
from tests.helpers import TIMEOUT, final, stream, wait_until_idle


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
    vocab = llama_engine.model_info.vocab_size
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
    await refused_while_another_runs(llama_engine, lambda: final(llama_engine, PROMPT, params), ValidationError, field)


# --- text -------------------------------------------------------------------------------------


async def test_undecodable_prompt_ids_stream_valid_text(llama_engine, tokenizer):
    prompt = list(range(len(tokenizer), llama_engine.model_info.vocab_size))[:24]
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
    "中文文本：你好，世界！",  # noqa: RUF001 - fullwidth punctuation on purpose: multi-byte characters
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
        *(
            stream(llama_engine, p, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=32, ignore_eos=True))
            for i, p in enumerate(SCRIPTS)
        )
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


async def test_a_stop_id_beyond_the_vocabulary_with_min_tokens_does_not_break_the_engine(llama_engine):
    vocab = llama_engine.model_info.vocab_size
    params = SamplingParams(max_tokens=4, min_tokens=2, temperature=0.0, stop_token_ids=[vocab + 5])
    out = await final(llama_engine, [5, 6, 7], params)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    await llama_engine.check_health()


@pytest.mark.parametrize("clean_up", [False, True])
def test_incremental_text_equals_decoding_all_ids_at_once(tokenizer, clean_up):
    # Without clean-up the detokenizer calls the Rust backend directly; with it, transformers' decode.
    tok = copy.deepcopy(tokenizer)
    tok.clean_up_tokenization_spaces = clean_up
    ids = [t for t in range(3, 400, 7)] + [tok.eos_token_id, 200, 201]
    detok = IncrementalDetokenizer(tok, [], False, True)
    streamed = "".join(detok.add([t], finished=i == len(ids) - 1)[0] for i, t in enumerate(ids))
    assert (detok._backend is None) == clean_up
    assert streamed == detok.text == tok.decode(ids, skip_special_tokens=True)


def test_ids_added_several_at_a_time_give_the_text_one_at_a_time_gives(tokenizer):
    # A decode window's sequence gets its tokens several at a time. A group that ends in part of a character must
    # still give the text of its ids before that part, as one id at a time does, also when it is the last group.
    probe = IncrementalDetokenizer(tokenizer, [], False, True)
    clean = [t for t in range(3, 500) if probe._decode([t]).isprintable() and probe._decode([t]).strip()]
    broken = next(t for t in range(3, len(tokenizer)) if probe._decode([t]).endswith("\ufffd"))
    ids = [*clean[:9], broken]
    one = IncrementalDetokenizer(tokenizer, [], False, True)
    singly = "".join(one.add([t], finished=i == len(ids) - 1)[0] for i, t in enumerate(ids))
    several = IncrementalDetokenizer(tokenizer, [], False, True)
    groups = [ids[:3], ids[3:6], ids[6:]]  # the last ends in the broken part
    grouped = "".join(several.add(g, finished=i == len(groups) - 1)[0] for i, g in enumerate(groups))
    assert grouped == singly == several.text == one.text == probe._decode(clean[:9])
