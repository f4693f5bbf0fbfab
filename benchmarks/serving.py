"""HTTP serving overhead: one streamed workload through ``POST /v1/completions`` and through the in-process API.

    python -m benchmarks serving [--model tiny|small|real] [--requests 64] [--concurrency 1,8,32,64] [--repeat 3]
                                 [--systems in_process,http_subprocess,http_same_process]

The workload is workload.py's fixed requests: prompts of U[16, 256] random token ids, sent as token ids so no
tokenizer is involved, and U[16, 128] new tokens. Requests are greedy, with ``ignore_eos`` and ``min_tokens =
max_tokens``, so every system generates exactly the tokens asked for; the benchmark checks every request's
count and stops if one differs. Every request also asks ``logprobs = 0``. The logprobs are the only per-token
field of an OpenAI completion chunk, so they are how the HTTP client counts the tokens each event carried. The
in-process side asks for them too, so both engines do the same work; the server's logprob fields (four lists
a chunk) make its chunks cost about 10 us more to build than plain ones. Prefix caching is off because every
run repeats the same prompts. The engines are float32 on CPU, and all of them run one engine config.

Systems:

- in-process: ``AsyncEngine.generate``, streaming, on this process's event loop: uvloop when installed, the
  same loop ``aioengine serve`` runs.
- HTTP, subprocess: ``python -m aioengine.cli serve --config FILE --port 0`` on 127.0.0.1, with the engine
  config above in FILE. The client runs here: one ``httpx.AsyncClient`` with ``stream: true`` and one pool of
  keep-alive HTTP/1.1 connections, as many as the concurrency. This is the number to quote, because a real
  server owns its process.
- HTTP, same process: ``aioengine.server.launch.Server`` on this process's own loop, with the same client. The
  client then competes with the server and its engine for one loop and one GIL, so this run shows the cost of
  sharing them, on top of the HTTP overhead.

A concurrency C is a closed loop: C requests are in flight (a semaphore), and the next one starts when one
ends, until all are done. Before each timed run, C warm-up requests of 2 tokens run at once; they also open
the client's C connections. Every repeat starts each system afresh: a new engine, server and client. At each
concurrency the systems then run back to back, in an order that rotates with the repeat, so adjacent runs
share the machine's load. A (system, concurrency) reports its median run by wall time.

How to read the table:

- TTFT runs from sending a request (once the semaphore lets it go) to the first event that carries a token.
  ITL is every gap between two events of one stream, divided by the tokens the later event carried, with one
  sample per token (as in online.py). Over HTTP an event is an SSE ``data:`` line, timed when the client has
  read it and before it parses the JSON.
- "vs in-process" is output tokens/s over the in-process run's at the same concurrency. It is the median of
  each repeat's ratio, taken between adjacent runs. Below 1.00x, HTTP costs throughput.
- tokens/event: above 1, the stream's consumer fell behind the engine. The engine then merges the outputs
  waiting for a request (``OutputCollector``), so the stream sends fewer, bigger events: the server keeps up
  by batching, and its per-token ITL then has a lumpy p99.
- loop CPU ms/token is the CPU time of the event-loop threads per output token: the client's (this process's
  main thread) plus, for the subprocess, the server's (``client + server``). The model's threads do the same
  work in every system, so this is where the HTTP overhead goes: work done, rather than time waited. The loop
  thread runs beside the worker (async scheduling), so that work costs throughput only once it no longer fits
  in a step, or when the cores are short: on a machine with few cores it takes time from torch's threads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np
import torch
import uvicorn

from aioengine import AsyncEngine, EngineConfig, SamplingParams
from aioengine.engine.sync import new_event_loop
from aioengine.server import config as serve_config
from aioengine.server.config import ServerConfig
from aioengine.server.launch import Server
from benchmarks.cpu_load import CpuLoad
from benchmarks.engine_run import engine_config
from benchmarks.loop_lag import percentile
from benchmarks.report import table
from benchmarks.throughput import log, median
from benchmarks.workload import DEFAULT_CACHE, MODELS, BenchRequest, checkpoint, output_tokens, vocab_size, workload

IN_PROCESS, HTTP_SUBPROCESS, HTTP_SAME = "in-process", "HTTP, subprocess", "HTTP, same process"
OPTION = {IN_PROCESS: "in_process", HTTP_SUBPROCESS: "http_subprocess", HTTP_SAME: "http_same_process"}
"""Each system's name in ``--systems``."""
SERVED_NAME = "bench"
"""The model name both servers serve and every HTTP request names."""
ROOT = Path(__file__).resolve().parent.parent
"""The checkout the server subprocess imports aioengine from, the same code as this process."""
START_TIMEOUT = 600.0
READ_TIMEOUT = 600.0
NOISY = 0.3
"""Above this many cores busy elsewhere (cpu_load.py), a run is flagged, as throughput's report does."""


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


@dataclasses.dataclass(frozen=True, slots=True)
class ServingRun:
    """One system at one concurrency: every request of the workload, C in flight."""

    system: str
    concurrency: int
    seconds: float
    requests_per_s: float
    tokens_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    tokens_per_event: float
    loop_cpu_per_token: float
    """CPU seconds of this process's main thread (its event loop) per output token."""
    server_loop_cpu_per_token: float | None
    """The same for the server subprocess's main thread; None without one."""
    others_load: float | None
    """Cores busy outside this process and the server subprocess (cpu_load.py): high means a noisy number."""


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


async def measure(system: System, reqs: list[BenchRequest], concurrency: int) -> ServingRun:
    """Warm-up, then every request of ``reqs`` with ``concurrency`` in flight."""
    warm_up = BenchRequest(reqs[0].prompt[:16], 2)
    await asyncio.gather(*(system.request(warm_up, Timings()) for _ in range(concurrency)))
    timings = Timings()
    gate = asyncio.Semaphore(concurrency)

    async def one(req: BenchRequest) -> int:
        async with gate:
            return await system.request(req, timings)

    loop, server, server_loop = time.thread_time(), process_cpu(system.pid), process_cpu(system.pid, thread=True)
    with CpuLoad() as load:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(r) for r in reqs))
        seconds = time.perf_counter() - start
    loop = time.thread_time() - loop  # this is the loop's thread
    server, server_loop = process_cpu(system.pid) - server, process_cpu(system.pid, thread=True) - server_loop
    short = [(c, r.max_tokens) for c, r in zip(counts, reqs, strict=True) if c != r.max_tokens]
    assert not short, f"{system.name} at concurrency {concurrency}: (got, asked) {short[:8]}; every system must match"
    tokens = output_tokens(reqs)
    return ServingRun(
        system=system.name,
        concurrency=concurrency,
        seconds=seconds,
        requests_per_s=len(reqs) / seconds,
        tokens_per_s=tokens / seconds,
        ttft_p50=percentile(timings.ttfts, 50),
        ttft_p99=percentile(timings.ttfts, 99),
        itl_p50=percentile(timings.itls, 50),
        itl_p99=percentile(timings.itls, 99),
        tokens_per_event=tokens / timings.events,
        loop_cpu_per_token=loop / tokens,
        server_loop_cpu_per_token=None if system.pid is None else server_loop / tokens,
        others_load=None if load.others is None else max(0.0, load.others - server / seconds),
    )


def write_toml(path: Path, sections: dict[str, dict[str, Any]]) -> None:
    """The engine sections as the ``--config`` file of ``aioengine serve`` (flat tables of str, int, bool)."""
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]  # JSON scalars are TOML's
        lines.append("")
    path.write_text("\n".join(lines))


def shared_config(path: Path, reqs: list[BenchRequest], max_num_seqs: int, config_file: Path) -> EngineConfig:
    """The one engine config, written to ``config_file`` too; checks the server reads it back the same."""
    base = engine_config(path, reqs, max_num_seqs, 512)
    sections = base.model_dump(mode="json", exclude_unset=True)
    sections["cache"]["enable_prefix_caching"] = False
    write_toml(config_file, sections)
    config = EngineConfig(**sections)
    _, _, shared = serve_config.load(config_file)
    assert serve_config.engine_config(SERVED_NAME, shared) == config, "the server would read another config"
    return config


async def run_all(
    config: EngineConfig, config_file: Path, reqs: list[BenchRequest], args: argparse.Namespace
) -> dict[tuple[str, int], list[ServingRun]]:
    """Every system at every concurrency, ``args.repeat`` times; each repeat starts the systems afresh."""
    openers: dict[str, Callable[[int], contextlib.AbstractAsyncContextManager[System]]] = {
        IN_PROCESS: lambda n: in_process(config, n),
        HTTP_SUBPROCESS: lambda n: subprocess_server(config_file, n),
        HTTP_SAME: lambda n: same_process(config, n),
    }
    chosen = [name for name in openers if OPTION[name] in args.systems]
    runs: dict[tuple[str, int], list[ServingRun]] = {(s, c): [] for s in chosen for c in args.concurrency}
    for i in range(args.repeat):
        order = chosen[i % len(chosen) :] + chosen[: i % len(chosen)]
        async with contextlib.AsyncExitStack() as stack:
            systems = [await stack.enter_async_context(openers[name](max(args.concurrency))) for name in order]
            log(f"repeat {i + 1} of {args.repeat}: {', '.join(order)} started")
            for concurrency in args.concurrency:
                for system in systems:
                    run = await measure(system, reqs, concurrency)
                    runs[system.name, concurrency].append(run)
                    log(
                        f"{system.name}, concurrency {concurrency}: {run.tokens_per_s:.1f} tok/s, "
                        f"TTFT p50 {_ms(run.ttft_p50)} ms, ITL p50 {_ms(run.itl_p50)} ms, "
                        f"{run.tokens_per_event:.2f} tokens/event"
                    )
    return runs


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _loop_cpu(run: ServingRun) -> str:
    client = run.loop_cpu_per_token * 1e3
    if run.server_loop_cpu_per_token is None:
        return f"{client:.2f}"
    server = run.server_loop_cpu_per_token * 1e3
    return f"{client + server:.2f} ({client:.2f} + {server:.2f})"


def markdown(title: str, runs: dict[tuple[str, int], list[ServingRun]]) -> str:
    """One row per (concurrency, system): its median run, and its tokens/s over the in-process run's."""
    head = [
        "concurrency",
        "system",
        "requests/s",
        "output tokens/s",
        "vs in-process",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "tokens/event",
        "loop CPU ms/token",
        "other load (cores)",
        "each repeat vs in-process",
    ]
    rows = []
    for (system, concurrency), repeats in sorted(runs.items(), key=lambda item: item[0][1]):
        run = median(repeats, lambda r: r.seconds)
        ratio, each = "-", "-"
        base = runs.get((IN_PROCESS, concurrency))
        if base is not None and system != IN_PROCESS:
            paired = [r.tokens_per_s / b.tokens_per_s for r, b in zip(repeats, base, strict=True)]
            ratio = f"{float(np.median(paired)):.2f}x"
            each = ", ".join(f"{p:.2f}" for p in paired)
        rows.append(
            [
                str(concurrency),
                system,
                f"{run.requests_per_s:.2f}",
                f"{run.tokens_per_s:.1f}",
                ratio,
                _ms(run.ttft_p50),
                _ms(run.ttft_p99),
                _ms(run.itl_p50),
                _ms(run.itl_p99),
                f"{run.tokens_per_event:.2f}",
                _loop_cpu(run),
                "-" if run.others_load is None else f"{run.others_load:.2f}",
                each,
            ]
        )
    lines = [title, "", *table(head, rows, left=(1, 12))]
    busy = [
        f"{r.system} at {r.concurrency} ({r.others_load:.2f})"
        for repeats in runs.values()
        for r in repeats
        if r.others_load is not None and r.others_load > NOISY
    ]
    if busy:
        lines += [
            "",
            f"**Noisy**: other processes kept cores busy during {', '.join(busy)}; a ratio can be off by tens "
            "of percent (compare the repeats). Rerun on a quiet machine.",
        ]
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where built checkpoints are kept")
    parser.add_argument("--requests", type=int, default=64, help="requests per run (a prefix of the fixed 64)")
    parser.add_argument("--concurrency", type=_ints, default=[1, 8, 32, 64], help="requests in flight, comma separated")
    parser.add_argument("--repeat", type=int, default=3, help="alternate the systems N times; report each's median")
    parser.add_argument(
        "--systems",
        type=lambda text: [x for x in text.split(",") if x],
        default=list(OPTION.values()),
        help=f"comma separated, of {', '.join(OPTION.values())} (default: all)",
    )
    args = parser.parse_args(argv)
    if unknown := set(args.systems) - set(OPTION.values()):
        parser.error(f"--systems: unknown {', '.join(sorted(unknown))}; choose from {', '.join(OPTION.values())}")
    if not args.concurrency or min(args.concurrency) < 1 or args.requests < 1 or args.repeat < 1:
        parser.error("--requests, --repeat and every --concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    path = checkpoint(args.model, args.cache)
    reqs = workload(args.requests, vocab_size(args.model))
    max_num_seqs = max(64, *args.concurrency)
    log(f"model {args.model} at {path}; {len(reqs)} requests, {output_tokens(reqs)} output tokens")
    with tempfile.TemporaryDirectory(prefix="aioengine-serving-") as tmp:
        config_file = Path(tmp) / "engine.toml"
        config = shared_config(path, reqs, max_num_seqs, config_file)
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            loop = type(runner.get_loop()).__module__.split(".")[0]
            runs = runner.run(run_all(config, config_file, reqs, args))
    title = (
        f"HTTP serving overhead: {len(reqs)} requests ({output_tokens(reqs)} output tokens, streamed), closed loop, "
        f"model {args.model}, float32 CPU, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, httpx {httpx.__version__}, uvicorn {uvicorn.__version__}, {loop} loop, "
        f"prefix caching off. " + (f"Median of {args.repeat} alternated runs." if args.repeat > 1 else "One run each.")
    )
    print(markdown(title, runs))
    print(f"\n({time.perf_counter() - started:.0f}s in all)")


if __name__ == "__main__":
    main()
