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
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import uvicorn

from aioengine import EngineConfig
from aioengine.engine.sync import new_event_loop
from aioengine.server import config as serve_config
from benchmarks.cpu_load import CpuLoad
from benchmarks.engine_run import engine_config
from benchmarks.loop_lag import percentile
from benchmarks.report import table
from benchmarks.serving_systems import (
    HTTP_SAME,
    HTTP_SUBPROCESS,
    IN_PROCESS,
    SERVED_NAME,
    System,
    Timings,
    in_process,
    process_cpu,
    same_process,
    subprocess_server,
)
from benchmarks.throughput import log, median
from benchmarks.workload import DEFAULT_CACHE, MODELS, BenchRequest, checkpoint, output_tokens, vocab_size, workload

OPTION = {IN_PROCESS: "in_process", HTTP_SUBPROCESS: "http_subprocess", HTTP_SAME: "http_same_process"}
"""Each system's name in ``--systems``."""
NOISY = 0.3
"""Above this many cores busy elsewhere (cpu_load.py), a run is flagged, as throughput's report does."""


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
