"""Shared set-up of the OpenAI-server tests (test_server_openai.py, test_server_openai_wire.py): the tiny
model's live server (no keys), the official client and a raw ``httpx`` client on it, and what both send.

The fixtures are named ``server``, ``client`` and ``http``; a test module imports them (``server_fixture``, ...)
so that pytest finds them there, which gives each module its own live server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import TIMEOUT
from tests.server_support import LiveServer, tiny_engines

MODEL = "tiny"
PROMPT = "The fox"
CHAT = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module", name="server")
def server_fixture(llama_ckpt: Path) -> Iterator[LiveServer]:
    """The tiny model, no keys, no admin endpoints."""
    with LiveServer(tiny_engines(llama_ckpt, name=MODEL)) as live:
        yield live


@pytest.fixture(scope="module", name="client")
def client_fixture(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module", name="http")
def http_fixture(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c
