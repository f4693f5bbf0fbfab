"""The OpenAI-compatible HTTP server, over real sockets, on the raw wire (``httpx``) where the official
``openai`` client hides it: the event stream's framing, errors in OpenAI's shape (and the server serving on after
each), the small endpoints (models, health, version, tokenize), keys, and the admin edge.

One live server per module on the tiny random-init checkpoint with no keys, and one with a user key and an
admin key. What the official client sends and gets is in test_server_openai.py.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from aioengine import __version__
from tests.helpers import TIMEOUT
from tests.openai_support import (
    CHAT,
    MODEL,
    PROMPT,
    client_fixture,  # noqa: F401 - fixtures, imported for pytest to find: client, http, server
    http_fixture,  # noqa: F401
    server_fixture,  # noqa: F401
)
from tests.server_support import LiveServer, tiny_engines

USER_KEY = "user-key"
ADMIN_KEY = "admin-key"
ANY = object()
"""``assert_error``'s "do not check this field"."""


# ---- servers and clients --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(llama_ckpt: Path) -> Iterator[LiveServer]:
    """The tiny model behind a user key, with admin endpoints behind an admin key."""
    with LiveServer(tiny_engines(llama_ckpt, name=MODEL), api_key=USER_KEY, admin_key=ADMIN_KEY) as live:
        yield live


@pytest.fixture(scope="module")
def keyed_http(keyed: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed.url, timeout=TIMEOUT) as c:
        yield c


# ---- helpers --------------------------------------------------------------------------------------------


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


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


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
