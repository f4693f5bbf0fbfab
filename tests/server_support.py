"""A live HTTP server for tests: real sockets on 127.0.0.1 (a free port), in a thread with its own loop.

The server's engines belong to that loop; ``call`` runs a coroutine there (to read an engine's state or
drive it), so tests never touch an engine from the wrong loop.

Below it, what the end-to-end server tests (test_server_traffic.py, test_server_admin.py,
test_server_process.py) share: completion bodies, streaming clients, waits on an engine's state, and the
fixtures ``server`` (one model, "tiny", with the admin endpoints), ``client`` and ``restored``; a test module
imports them (``server_fixture``, ...) so that pytest finds them there, which gives each module its own live
server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from aioengine.config import EngineConfig
from aioengine.engine.pool import EnginePool
from aioengine.engine.stats import EngineStats
from aioengine.engine.sync import new_event_loop
from aioengine.server.config import ServerConfig
from aioengine.server.launch import Server
from tests.conftest import engine_config

T = TypeVar("T")
START_TIMEOUT = 120.0


class LiveServer:
    """``with LiveServer(engines, admin_key=...) as server:`` -> ``server.url``, ``server.base_url`` (…/v1)."""

    def __init__(self, engines: dict[str, EngineConfig], **server: Any) -> None:
        self.config = ServerConfig(**{"port": 0, **server})
        self.server = Server(self.config, engines)
        self.loop = new_event_loop()
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="aioengine-test-server", daemon=True)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def pool(self) -> EnginePool:
        return self.server.pool

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self.url = await self.server.start()
        self._ready.set()
        await self.server.run()

    def __enter__(self) -> LiveServer:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT):
            raise AssertionError(f"the server did not start within {START_TIMEOUT}s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(abort=True)
        self._thread.join(60)
        assert not self._thread.is_alive(), "the server thread did not stop"

    def stop(self, abort: bool | None = None) -> None:
        if self._thread.is_alive() and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.server.stop, abort)

    def call(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: float = 60.0) -> T:
        """Runs ``make()`` on the server's loop and returns its result."""
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(make(), self.loop)
        return future.result(timeout)

    def stats(self, model: str | None = None) -> Any:
        """An engine's ``EngineStats``, read on the server's loop."""
        name = model or next(iter(self.pool.tenants))

        async def read() -> Any:
            return self.pool.engine(name).stats()

        return self.call(read)


def tiny_engines(path: Path, name: str = "tiny", **sections: Any) -> dict[str, EngineConfig]:
    """One model ``name`` on the random-init checkpoint at ``path`` (CPU, float32, a small cache)."""
    sections.setdefault("cache", {"num_blocks": 256})
    return {name: engine_config(path, **sections)}


# ---- the end-to-end server tests' shared pieces ---------------------------------------------------------
ADMIN_KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [42, 43, 44, 45, 46]]
SHORT = 8
"""Tokens of a request whose output is compared with a reference."""
LONG = 1500
"""Tokens of a stream that must be cut short: minutes of decoding on CPU, so finishing it would show."""
WAIT = 60.0
"""Seconds any wait on the server may take before its test fails."""


def greedy(prompt: list[int], max_tokens: int, model: str = "tiny", **extra: Any) -> dict[str, Any]:
    """A completion body: greedy, EOS ignored, so it runs exactly ``max_tokens`` unless stopped."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


# ---- servers and clients -------------------------------------------------------------------------------
@pytest.fixture(scope="module", name="server")
def server_fixture(llama_ckpt: Path) -> Iterator[LiveServer]:
    """One model, "tiny" (checkpoint A), with the admin endpoints; tests that change it put it back."""
    with LiveServer(tiny_engines(llama_ckpt, cache={"num_blocks": 256}), admin_key=ADMIN_KEY) as live:
        yield live


@contextlib.asynccontextmanager
async def client_of(live: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=live.url, timeout=WAIT, limits=limits) as client:
        yield client


_background: set[asyncio.Task[Any]] = set()
"""Requests a test runs in the background; the ``client`` fixture ends those a failed test left."""


def background(work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    task = asyncio.create_task(work)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


@pytest.fixture(name="client")
async def client_fixture(server: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the module's server; requests a failed test left running are cancelled (their connections
    closed) before the client goes."""
    async with client_of(server) as client:
        yield client
        left = list(_background)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)


@pytest.fixture(name="restored")
def restored_fixture(server: LiveServer) -> Iterator[LiveServer]:
    """The module's server, put back afterwards: resumed, awake, on checkpoint A again if its weights changed."""
    version = server.stats().weights_version
    yield server
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=WAIT) as admin:
        for path in ("/resume", "/wake_up"):
            admin.post(path).raise_for_status()
        stats = server.stats()
        if stats.weights_version != version or not stats.weights_valid:
            admin.post("/reload_weights").raise_for_status()
    server.call(lambda: until_idle(server))


# ---- reading the server's state ------------------------------------------------------------------------
async def on_server(live: LiveServer, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Runs ``make()`` on the server's loop without blocking this one (whose clients the server is serving)."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make(), live.loop))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An engine's stats and how many HTTP requests hold it (``EnginePool.use``), read together."""

    stats: EngineStats
    held: int


def snapshot(live: LiveServer, model: str) -> Snapshot:
    """On the server's loop only."""
    return Snapshot(live.pool.engine(model).stats(), live.pool.stats().active[model])


def is_idle(s: Snapshot) -> bool:
    stats = s.stats
    return (
        stats.kv_blocks_free == stats.kv_blocks_total > 0
        and stats.requests_running == stats.requests_waiting == stats.requests_held == 0
        and s.held == 0
    )


async def until(
    live: LiveServer, condition: Callable[[Snapshot], bool], what: str, model: str = "tiny", timeout: float = WAIT
) -> Snapshot:
    """Polls the engine (on the server's loop when called there, else from this loop) until ``condition``."""
    deadline = time.monotonic() + timeout
    here = asyncio.get_running_loop() is live.loop
    while True:
        if here:
            now = snapshot(live, model)
        else:

            async def read() -> Snapshot:
                return snapshot(live, model)

            now = await on_server(live, read)
        if condition(now):
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what} after {timeout}s: {now}")
        await asyncio.sleep(0.005)


async def until_idle(live: LiveServer, model: str = "tiny") -> Snapshot:
    return await until(live, is_idle, "idle: every KV block free, nothing running, waiting or held", model)


# ---- requests ------------------------------------------------------------------------------------------
async def admin(client: httpx.AsyncClient, endpoint: str, **args: Any) -> httpx.Response:
    return await client.post(endpoint, json=args, headers=ADMIN)


async def complete(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@dataclass(slots=True)
class Streamed:
    """What a streaming client read: every chunk, whether ``data: [DONE]`` came, an error event if one did."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    error: dict[str, Any] | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by the first chunk with text: the request is running in the engine."""

    @property
    def choices(self) -> list[dict[str, Any]]:
        return [c["choices"][0] for c in self.chunks if c["choices"]]

    @property
    def text(self) -> str:
        return "".join(c["text"] for c in self.choices)

    @property
    def tokens(self) -> int:
        """Tokens streamed, counted from the chunks' logprobs (a request with ``logprobs``; a chunk may bring
        several tokens when the client reads slower than the engine decodes)."""
        return sum(len(c["logprobs"]["tokens"]) for c in self.choices)

    @property
    def finish_reason(self) -> str | None:
        return self.choices[-1]["finish_reason"] if self.choices else None

    @property
    def usage(self) -> dict[str, int] | None:
        return self.chunks[-1].get("usage") if self.chunks else None

    @property
    def fingerprints(self) -> list[str]:
        """The system_fingerprint of each chunk with a choice, in order (duplicates folded)."""
        return list(dict.fromkeys(c["system_fingerprint"] for c in self.chunks if c["choices"]))

    def take(self, line: str) -> bool:
        """Reads one line of the event stream; True if it was a chunk with text (a token)."""
        if not line:
            return False
        assert line.startswith("data: "), line
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            self.done = True
            return False
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = chunk
            return False
        self.chunks.append(chunk)
        if chunk["choices"] and chunk["choices"][0]["text"]:
            self.started.set()
            return True
        return False


def streaming(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


async def stream(
    client: httpx.AsyncClient, body: dict[str, Any], into: Streamed | None = None, leave_after: int | None = None
) -> Streamed:
    """Streams a completion; with ``leave_after`` the client closes the connection after that many chunks."""
    got = into if into is not None else Streamed()
    async with client.stream("POST", "/v1/completions", json=streaming(body)) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            got.take(line)
            if leave_after is not None and len(got.choices) >= leave_after:
                return got  # leaving the block closes the response: the server sees the client go
    return got


def assert_finished(got: list[Streamed], max_tokens: int) -> None:
    """Every stream ran to its last token and ended with the usage chunk and ``[DONE]``."""
    for i, s in enumerate(got):
        assert s.error is None, (i, s.error)
        assert (s.finish_reason, s.done) == ("length", True), (i, s.finish_reason, s.done)
        assert s.usage is not None and s.usage["completion_tokens"] == max_tokens, (i, s.usage)


def assert_aborted(got: list[Streamed], max_tokens: int = LONG) -> None:
    """Every stream ended early with finish_reason "abort", then ``[DONE]``."""
    for i, s in enumerate(got):
        assert s.error is None, (i, s.error)
        assert (s.finish_reason, s.done) == ("abort", True), (i, s.finish_reason, s.done)
        assert s.usage is not None and s.usage["completion_tokens"] < max_tokens, (i, s.usage)
