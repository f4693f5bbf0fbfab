"""Specification of one request's life through the public API: AsyncEngine.generate / abort.

Expected outputs are never copied from the engine: a test derives them from a first run of the
same engine (e.g. a stop string taken from the greedy text), from an independent tokenizer, or
from a checkpoint built so that the behaviour must show.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from aioengine.errors import InvalidRequestError
from tests.conftest import engine_config
from tests.engine_request_support import LONG, PROMPT, SEEDED, assert_deltas_build_the_text, decoded, greedy
from tests.helpers import TIMEOUT, final, stream, wait_until, wait_until_idle


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
    baseline = llama_engine.stats().num_generated_tokens
    others = [asyncio.create_task(final(llama_engine, p, sp)) for p, sp in other_requests()]
    await wait_until(lambda: llama_engine.stats().num_generated_tokens >= baseline + len(others), "neighbours decoding")
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
async def stop_case(llama_ckpt, tokenizer) -> AsyncIterator[tuple[AsyncEngine, RequestOutput, str, int]]:
    """(engine, the greedy run without stop, a stop string from its middle, tokens until it shows). The engine runs
    one step at a time (no decode windows), so the run without stop streams a delta per token, as a request with
    stop strings, which never runs in a window, streams them."""
    async with AsyncEngine(engine_config(llama_ckpt, scheduler={"decode_steps": 1})) as engine:
        reference = await stream(engine, PROMPT, greedy(24, ignore_eos=True))
        stop = stop_string_across_a_delta_boundary(reference)
        ids = reference[-1].token_ids
        needed = next(m for m in range(1, len(ids) + 1) if stop in decoded(tokenizer, ids[:m]))
        yield engine, reference[-1], stop, needed


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
    assert llama_engine.stats().requests_running == 1
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
    assert llama_engine.stats().requests_running == 1
    await agen.aclose()
    await wait_until_idle(llama_engine)


async def test_engine_serves_normally_after_an_abort(llama_engine):
    reference = await final(llama_engine, PROMPT, greedy(10, ignore_eos=True))
    async with asyncio.timeout(TIMEOUT):
        async for _ in llama_engine.generate(PROMPT, greedy(LONG, ignore_eos=True), request_id="gone"):
            await llama_engine.abort("gone")
    again = await final(llama_engine, PROMPT, greedy(10, ignore_eos=True), request_id="gone")
    assert again.token_ids == reference.token_ids


async def test_submit_refuses_a_bad_request_before_queueing_anything(llama_engine):
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        await llama_engine.submit(PROMPT, greedy(10**9))
    stats = llama_engine.stats()
    assert stats.requests_running == stats.requests_waiting == 0


async def test_submit_queues_the_request_before_its_stream_is_read(llama_engine):
    stream = await llama_engine.submit(PROMPT, greedy(4, ignore_eos=True))
    assert llama_engine.stats().requests_running + llama_engine.stats().requests_waiting == 1
    outputs = [out async for out in stream]
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 4
    assert outputs[-1].token_ids == (await final(llama_engine, PROMPT, greedy(4, ignore_eos=True))).token_ids


async def test_closing_a_submitted_stream_before_reading_it_aborts_the_request(llama_engine):
    stream = await llama_engine.submit(PROMPT, greedy(LONG, ignore_eos=True))
    await wait_until(lambda: llama_engine.stats().requests_running == 1, "the request running")
    await stream.aclose()
    await wait_until_idle(llama_engine)
    assert [out async for out in stream] == [], "a closed stream yields nothing more"


async def test_abort_all_ends_every_request_with_reason_abort(llama_engine):
    streams = [await llama_engine.submit(PROMPT, greedy(LONG, ignore_eos=True)) for _ in range(3)]
    await wait_until(lambda: llama_engine.stats().requests_running == 3, "three requests running")
    assert llama_engine.abort_all() == 3
    async with asyncio.timeout(TIMEOUT):
        finals = [[out async for out in s][-1] for s in streams]
    assert [out.finish_reason for out in finals] == ["abort"] * 3
    await wait_until_idle(llama_engine)


# --- a slow consumer --------------------------------------------------------------------------
async def test_a_slow_consumer_gets_merged_outputs_and_loses_nothing(llama_engine):
    # The consumer reads an output only once the engine generated 3 more tokens (or finished): the
    # engine must not wait for it, and the outputs it finally reads must add up to the whole request.
    params = greedy(24, ignore_eos=True)
    reference = await final(llama_engine, PROMPT, params)
    outputs: list[RequestOutput] = []
    agen = llama_engine.generate(PROMPT, params)
    async with asyncio.timeout(TIMEOUT):
        while not (outputs and outputs[-1].finished):
            generated = llama_engine.stats().num_generated_tokens

            def moved_on(generated: int = generated) -> bool:
                stats = llama_engine.stats()
                done = stats.requests_running == stats.requests_waiting == 0  # (or not started yet)
                return done or stats.num_generated_tokens >= generated + 3

            await wait_until(moved_on, "3 more tokens generated while the consumer waits")
            outputs.append(await anext(agen))
    await agen.aclose()
    last = outputs[-1]
    assert last.token_ids == reference.token_ids and last.text == reference.text
    assert [t for o in outputs for t in o.delta_token_ids] == last.token_ids
    assert "".join(o.delta_text for o in outputs) == last.text
    assert len(outputs) < len(last.token_ids), "a lagging consumer's outputs are merged, not queued"
    assert max(len(o.delta_token_ids) for o in outputs) >= 3
    await wait_until_idle(llama_engine)


def test_a_lagging_stream_never_merges_outputs_computed_with_different_weights() -> None:
    from aioengine.engine.outputs import CompletionOutput, OutputCollector, RequestOutput

    def out(tokens: list[int], version: int) -> RequestOutput:
        sample = CompletionOutput(0, tokens, "", delta_token_ids=tokens)
        return RequestOutput("r", [1], [sample], False, weights_version=version)

    collector = OutputCollector()
    collector.put(out([10], 0))
    collector.put(out([11], 0))  # same weights: merged
    collector.put(out([12], 1))  # new weights: kept apart
    got = []

    async def read() -> None:
        for _ in range(2):
            got.append(await collector.get())

    asyncio.run(read())
    assert [(o.delta_token_ids, o.weights_version) for o in got] == [([10, 11], 0), ([12], 1)]
