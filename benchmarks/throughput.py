"""Offline and online throughput: aioengine beside HF transformers, same checkpoint, same run.

    python -m benchmarks throughput [--requests 64] [--model tiny|small|real] [--out bench_out/]

Systems, in one process, one after the other: aioengine (every request submitted at once), HF
``generate`` in static left-padded batches of 8, 32 and 64, and HF's own continuous batching, each
run ``--repeats`` times (default 3; a shared machine is noisy) and reported by its median run. Then
two floors for aioengine's steps (replayed on the worker; GEMMs alone) and aioengine online under
Poisson arrivals at three shares of its offline request rate. Workload and models: workload.py.
Writes a markdown table to stdout, and JSON + PNG under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers

from aioengine import AsyncEngine
from benchmarks import hf_baselines, report
from benchmarks.engine_run import EngineRun, engine_config, run_offline
from benchmarks.floors import measure_floors
from benchmarks.online import serve_poisson
from benchmarks.results import Floors, OnlineResult, SystemResult
from benchmarks.workload import DEFAULT_CACHE, MODELS, BenchRequest, checkpoint, output_tokens, vocab_size, workload


def log(message: str) -> None:
    """Progress on stderr, so stdout holds only the report."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def run_engine(
    path: Path,
    reqs: list[BenchRequest],
    args: argparse.Namespace,
) -> tuple[EngineRun, Floors | None, list[OnlineResult]]:
    """One engine for the offline run, its floors, then the online rates (which need the offline rate)."""
    config = engine_config(path, reqs, args.max_num_seqs, args.max_batched_tokens)
    async with AsyncEngine(config) as engine:
        runs = []
        for _ in range(args.repeats):
            runs.append(await run_offline(engine, reqs))
            log(
                f"aioengine: {runs[-1].result.tokens_per_s:.1f} tok/s, "
                f"{runs[-1].num_steps} steps in {runs[-1].wall:.2f}s"
            )
        run = median(runs, lambda r: r.wall)
        run = dataclasses.replace(run, result=with_spread(run.result, [r.result for r in runs]))
        floors = await measure_floors(engine, run.steps)
        if floors is not None:
            log(f"floors: replay {floors.replay_seconds:.2f}s, GEMMs {floors.gemm_seconds:.2f}s")
        online = []
        offline_rps = len(reqs) / run.wall
        for fraction in args.rates if args.online_requests else []:
            result = await serve_poisson(engine, reqs[: args.online_requests], offline_rps * fraction, fraction)
            log(f"online at {fraction:.0%}: TTFT p50 {result.ttft_p50 or 0:.3f}s, ITL p50 {result.itl_p50 or 0:.4f}s")
            online.append(result)
    return run, floors, online


def run_hf(path: Path, reqs: list[BenchRequest], args: argparse.Namespace) -> list[SystemResult]:
    """The HF systems, after the engine has shut down (each loads its own model copy)."""
    runs: list[Callable[[], SystemResult]] = [
        functools.partial(hf_baselines.run_hf_static, path, reqs, batch_size) for batch_size in args.hf_batch_sizes
    ]
    if args.hf_cb:
        runs.append(
            functools.partial(hf_baselines.run_hf_continuous, path, reqs, args.max_batched_tokens, args.max_num_seqs)
        )
    systems = []
    for run in runs:
        results = []
        for _ in range(args.repeats):
            results.append(run())
            log(f"{results[-1].name}: {results[-1].tokens_per_s or 0:.1f} tok/s {results[-1].note}")
            if results[-1].tokens_per_s is None:
                break  # not available: no point in trying again
        systems.append(with_spread(median(results, lambda r: r.seconds or 0.0), results))
    return systems


T = TypeVar("T")


def median(runs: list[T], key: Callable[[T], float]) -> T:
    """The run in the middle by ``key`` (the slower of the middle two for an even count)."""
    return sorted(runs, key=key)[len(runs) // 2]


def with_spread(chosen: SystemResult, runs: list[SystemResult]) -> SystemResult:
    """``chosen`` with a note of how its repeats spread, when there were several."""
    rates = [r.tokens_per_s for r in runs if r.tokens_per_s is not None]
    if len(rates) < 2:
        return chosen
    spread = f"median of {len(rates)} runs ({min(rates):.0f}-{max(rates):.0f} tok/s)"
    return dataclasses.replace(chosen, note="; ".join(n for n in (chosen.note, spread) if n))


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=64, help="offline requests (a prefix of the fixed 64)")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="where the JSON and PNG go")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where built checkpoints are kept")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--hf-batch-sizes", type=_ints, default=[8, 32, 64], help="comma separated; empty: none")
    parser.add_argument("--no-hf-cb", dest="hf_cb", action="store_false", help="skip HF continuous batching")
    parser.add_argument(
        "--repeats", type=int, default=3, help="offline runs of every system; each reports its median run"
    )
    parser.add_argument("--online-requests", type=int, default=32, help="requests per online rate; 0: no online")
    parser.add_argument(
        "--rates",
        type=_floats,
        default=[0.25, 0.5, 0.9],
        help="online arrival rates as shares of the offline request rate",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    path = checkpoint(args.model, args.cache)
    reqs = workload(args.requests, vocab_size(args.model))
    log(f"model {args.model} at {path}; {len(reqs)} requests, {output_tokens(reqs)} output tokens")
    run, floors, online = asyncio.run(run_engine(path, reqs, args))
    systems = run_hf(path, reqs, args)

    title = (
        f"{len(reqs)} requests ({output_tokens(reqs)} output tokens), model {args.model}, float32 CPU, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )
    print(report.markdown(title, run, systems, floors, online))
    meta: dict[str, Any] = {
        "model": args.model,
        "model_spec": MODELS[args.model],
        "num_requests": len(reqs),
        "output_tokens": output_tokens(reqs),
        "max_num_seqs": args.max_num_seqs,
        "max_batched_tokens": args.max_batched_tokens,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "unix_time": time.time(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"throughput_{args.model}"
    report.write_json(stem.with_suffix(".json"), meta, run, systems, floors, online)
    plotted = report.write_plot(stem.with_suffix(".png"), title, run, systems, online)
    written = f"{stem}.json" + (f" and {stem}.png" if plotted else "")
    print(f"\nwrote {written} ({time.perf_counter() - started:.0f}s in all)")
    if not plotted:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
