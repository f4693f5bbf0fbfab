"""The systems ``benchmarks serving`` runs its workload through, each a way to send one request and time its
stream: the in-process engine, and ``POST /v1/completions`` against a server in a subprocess or on this loop.
See serving.py for what is measured and how to read it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import httpx

from aioengine import AsyncEngine, EngineConfig, SamplingParams
from aioengine.server import config as serve_config
from aioengine.server.config import ServerConfig
from aioengine.server.launch import Server
from benchmarks.throughput import log
from benchmarks.workload import BenchRequest

IN_PROCESS, HTTP_SUBPROCESS, HTTP_SAME = "in-process", "HTTP, subprocess", "HTTP, same process"
SERVED_NAME = "bench"
"""The model name both servers serve and every HTTP request names."""
ROOT = Path(__file__).resolve().parent.parent
"""The checkout the server subprocess imports aioengine from, the same code as this process."""
START_TIMEOUT = 600.0
READ_TIMEOUT = 600.0


@dataclasses.dataclass(slots=True)
class Timings:
    """What the client saw over one run: TTFTs, per-token ITLs and how many events carried tokens."""

    ttfts: list[float] = dataclasses.field(default_factory=list)
    itls: list[float] = dataclasses.field(default_factory=list)
    events: int = 0


class Clock:
    """One stream's timeline: ``tick(tokens, now)`` for every event, with the tokens it carried."""

    def __init__(self, timings: Timings) -> None:
        self.timings = timings
        self.sent = time.perf_counter()
        self.last: float | None = None
        self.tokens = 0

    def tick(self, tokens: int, now: float) -> None:
        if not tokens:
            return
        if self.last is None:
            self.timings.ttfts.append(now - self.sent)
        else:
            self.timings.itls.extend([(now - self.last) / tokens] * tokens)
        self.timings.events += 1
        self.tokens += tokens
        self.last = now


class System(Protocol):
    """What ``measure`` runs a workload through: one way to send a request and stream its answer."""

    name: str
    pid: int | None
    """The server's process when it has one of its own."""

    async def request(self, req: BenchRequest, timings: Timings) -> int:
        """Streams one request to its end, ticking a Clock on ``timings``; returns the tokens it generated."""
        ...


def greedy(req: BenchRequest) -> SamplingParams:
    """Exactly ``max_tokens`` greedy tokens, with the chosen token's logprob (see the module docstring)."""
    n = req.max_tokens
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True, logprobs=0)


class InProcess:
    """``AsyncEngine.generate`` on this process's loop."""

    name = IN_PROCESS
    pid: int | None = None

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def request(self, req: BenchRequest, timings: Timings) -> int:
        clock = Clock(timings)
        async for out in self.engine.generate(req.prompt, greedy(req)):
            clock.tick(sum(len(o.delta_token_ids) for o in out.outputs), time.perf_counter())
        return clock.tokens


class HTTP:
    """Streamed ``POST /v1/completions`` through one httpx client (HTTP/1.1 keep-alive connections)."""

    def __init__(self, name: str, client: httpx.AsyncClient, pid: int | None = None) -> None:
        self.name = name
        self.client = client
        self.pid = pid

    async def request(self, req: BenchRequest, timings: Timings) -> int:
        n = req.max_tokens
        body = {
            "model": SERVED_NAME,
            "prompt": req.prompt,
            "max_tokens": n,
            "min_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        clock = Clock(timings)
        usage = None
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"{self.name}: HTTP {response.status_code}: {response.text[:500]}")
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"{self.name}: the stream ended in an error: {chunk['error']}")
                clock.tick(sum(len(c["logprobs"]["tokens"]) for c in chunk["choices"]), now)
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
        assert usage == clock.tokens, f"{self.name}: usage says {usage} tokens, the stream carried {clock.tokens}"
        return clock.tokens


def process_cpu(pid: int | None, thread: bool = False) -> float:
    """User + system CPU seconds of process ``pid``: all its threads, or its main thread only (Linux /proc;
    0 elsewhere, and for None)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/task/{pid}/stat" if thread else f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@contextlib.asynccontextmanager
async def client(url: str, connections: int) -> AsyncIterator[httpx.AsyncClient]:
    """One pool that keeps ``connections`` connections alive (httpx keeps 20 by default, and a higher
    concurrency would then reconnect). ``trust_env=False``: no proxy from the environment between the two.
    The timeout bounds each read of a stream, so only a server that stalls for minutes trips it."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=READ_TIMEOUT, trust_env=False) as c:
        yield c


@contextlib.asynccontextmanager
async def in_process(config: EngineConfig, connections: int) -> AsyncIterator[System]:
    """An engine on this loop (``connections`` is for the HTTP systems' signature)."""
    async with AsyncEngine(config) as engine:
        yield InProcess(engine)


@contextlib.asynccontextmanager
async def same_process(config: EngineConfig, connections: int) -> AsyncIterator[System]:
    """``Server`` on this loop, port 0."""
    server = Server(ServerConfig(port=0, shutdown="abort"), {SERVED_NAME: config})
    url = await server.start()
    serving = asyncio.create_task(server.run())
    try:
        async with client(url, connections) as c:
            yield HTTP(HTTP_SAME, c)
    finally:
        server.stop()
        await serving


@contextlib.asynccontextmanager
async def subprocess_server(config_file: Path, connections: int) -> AsyncIterator[System]:
    """``aioengine serve`` in a child process, port 0; its start line on stderr names the URL."""
    env = {k: v for k, v in os.environ.items() if k not in (serve_config.API_KEY_ENV, serve_config.ADMIN_KEY_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    argv = ["-m", "aioengine.cli", "serve", "--config", str(config_file), "--port", "0"]
    argv += ["--served-model-name", SERVED_NAME, "--shutdown", "abort"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        cwd=ROOT,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    stderr = proc.stderr
    assert stderr is not None
    lines: deque[str] = deque(maxlen=40)
    drain: asyncio.Task[None] | None = None

    async def keep_draining() -> None:  # a full pipe would block the server's next write to stderr
        while line := await stderr.readline():
            lines.append(line.decode(errors="replace"))

    try:
        url = await asyncio.wait_for(_start_line(stderr, lines), START_TIMEOUT)
        if url is None:
            raise RuntimeError(f"the server subprocess exited ({await proc.wait()}) before serving:\n" + "".join(lines))
        drain = asyncio.create_task(keep_draining())
        async with client(url, connections) as c:
            yield HTTP(HTTP_SUBPROCESS, c, proc.pid)
    except Exception:
        log("the server subprocess's last lines on stderr:\n" + "".join(lines))
        raise
    finally:
        if proc.returncode is None:
            proc.terminate()  # SIGTERM: the server aborts what is in flight and exits 0
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if drain is not None:
            await drain


async def _start_line(stderr: asyncio.StreamReader, lines: deque[str]) -> str | None:
    """The URL from ``aioengine: serving NAME at URL/v1 ...``; None if stderr ends first."""
    while line := (await stderr.readline()).decode(errors="replace"):
        lines.append(line)
        if found := re.search(r" serving .* at (\S+)/v1 ", line):
            return found.group(1)
    return None
