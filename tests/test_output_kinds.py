"""What a request's stream yields (``SamplingParams.output_kind``, ``detokenize``): an output at every step, or one
once the request ends (vLLM's FINAL_ONLY, which the blocking ``Engine.generate`` uses); with text, or token ids
only. The tokens are the same every way."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from aioengine import AsyncEngine, SamplingParams
from tests.helpers import TIMEOUT, stream, wait_until, wait_until_idle

PROMPT = [5, 17, 230, 41, 8, 99, 310, 12]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


async def test_final_only_yields_one_output_holding_what_the_stream_held(llama_engine: AsyncEngine) -> None:
    streamed = await stream(llama_engine, PROMPT, SamplingParams(**GREEDY))
    assert len(streamed) > 1
    [only] = await stream(llama_engine, PROMPT, SamplingParams(**GREEDY, output_kind="final_only"))
    last = streamed[-1].outputs[0]
    out = only.outputs[0]
    assert only.finished and out.finish_reason == last.finish_reason == "length"
    assert out.token_ids == last.token_ids and len(out.token_ids) == 12
    assert out.text == last.text
    # Its deltas are everything since the last output: the whole of it.
    assert out.delta_token_ids == out.token_ids and out.delta_text == out.text


async def test_final_only_with_n_samples_is_one_output_once_every_sample_ended(llama_engine: AsyncEngine) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=9, output_kind="final_only")
    [only] = await stream(llama_engine, PROMPT, params)
    assert only.finished and sorted(o.index for o in only.outputs) == [0, 1, 2]
    assert all(o.finish_reason is not None and o.delta_token_ids == o.token_ids for o in only.outputs)
    streamed = await stream(llama_engine, PROMPT, params.model_copy(update={"output_kind": "stream"}))
    assert [o.token_ids for o in streamed[-1].outputs] == [o.token_ids for o in only.outputs]  # the same seeds


async def test_an_aborted_final_only_request_still_gets_its_one_output(llama_engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True, output_kind="final_only")
    outputs = []

    async def consume() -> None:
        async for out in llama_engine.generate(PROMPT, params, request_id="final-abort"):
            outputs.append(out)

    task = asyncio.create_task(consume())
    await wait_until(lambda: llama_engine.stats().num_generated_tokens > 0, "the request generating")
    assert not outputs  # nothing before its end
    assert await llama_engine.abort("final-abort")
    await asyncio.wait_for(task, TIMEOUT)
    [out] = outputs
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids
    await wait_until_idle(llama_engine)


async def test_without_detokenize_the_tokens_come_without_text(llama_engine: AsyncEngine) -> None:
    with_text = await stream(llama_engine, PROMPT, SamplingParams(**GREEDY))
    ids_only = await stream(llama_engine, PROMPT, SamplingParams(**GREEDY, detokenize=False))
    assert with_text[-1].outputs[0].text  # the checkpoint's tokenizer makes text of these
    assert ids_only[-1].outputs[0].token_ids == with_text[-1].outputs[0].token_ids  # (steps may group otherwise)
    assert all(o.outputs[0].text == o.outputs[0].delta_text == "" for o in ids_only)


def test_stop_strings_without_detokenize_are_refused_naming_both() -> None:
    with pytest.raises(ValidationError, match=r"stop strings.*detokenize=True"):
        SamplingParams(stop=["\n"], detokenize=False)
    SamplingParams(stop_token_ids=[2], detokenize=False)  # token ids need no text


def test_output_kind_is_one_of_the_two_named() -> None:
    with pytest.raises(ValidationError, match="output_kind"):
        SamplingParams(output_kind="delta")  # type: ignore[arg-type]
