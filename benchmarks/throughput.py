"""Offline and online throughput: aioengine beside HF transformers, same checkpoint, same run.

    python -m benchmarks throughput [--requests 64] [--model tiny|small] [--out bench_out/]

Systems, in one process, one after the other: aioengine (every request submitted at once), HF
``generate`` in static left-padded batches of 8, 32 and 64, and HF's own continuous batching. Then
two floors for aioengine's steps (replayed on the worker; GEMMs alone) and aioengine online under
Poisson arrivals at three shares of its offline request rate. Workload and models: workload.py.
Writes a markdown table to stdout, and JSON + PNG under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time
from pathlib import Path
from typing import Any

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


async def run_engine(path: Path, reqs: list[BenchRequest], args: argparse.Namespace,
                     ) -> tuple[EngineRun, Floors | None, list[OnlineResult]]:  # fmt: skip
    """One engine for the offline run, its floors, then the online rates (which need the offline rate)."""
    config = engine_config(path, reqs, args.max_num_seqs, args.max_batched_tokens)
    async with AsyncEngine(config) as engine:
        run = await run_offline(engine, reqs)
        log(f"aioengine: {run.result.tokens_per_s:.1f} tok/s, {run.num_steps} steps in {run.wall:.2f}s")
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
    systems = []
    for batch_size in args.hf_batch_sizes:
        systems.append(hf_baselines.run_hf_static(path, reqs, batch_size))
        log(f"{systems[-1].name}: {systems[-1].tokens_per_s:.1f} tok/s")
    if args.hf_cb:
        systems.append(hf_baselines.run_hf_continuous(path, reqs, args.max_batched_tokens, args.max_num_seqs))
        log(f"{systems[-1].name}: {systems[-1].tokens_per_s or 0:.1f} tok/s {systems[-1].note}")
    return systems


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--requests", type=int, default=64, help="offline requests (a prefix of the fixed 64)")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="where the JSON and PNG go")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where built checkpoints are kept")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--hf-batch-sizes", type=_ints, default=[8, 32, 64], help="comma separated; empty: none")
    parser.add_argument("--no-hf-cb", dest="hf_cb", action="store_false", help="skip HF continuous batching")
    parser.add_argument("--online-requests", type=int, default=32, help="requests per online rate; 0: no online")
    parser.add_argument("--rates", type=_floats, default=[0.25, 0.5, 0.9],
                        help="online arrival rates as shares of the offline request rate")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    path = checkpoint(args.model, args.cache)
    reqs = workload(args.requests, vocab_size(args.model))
    log(f"model {args.model} at {path}; {len(reqs)} requests, {output_tokens(reqs)} output tokens")
    run, floors, online = asyncio.run(run_engine(path, reqs, args))
    systems = run_hf(path, reqs, args)

    title = (f"{len(reqs)} requests ({output_tokens(reqs)} output tokens), model {args.model}, float32 CPU, "
             f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
             f"transformers {transformers.__version__}")  # fmt: skip
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
