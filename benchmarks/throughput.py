"""Offline and online throughput: aioengine beside vLLM's CPU engine and HF transformers, same
checkpoint, same run, under a FLOP ceiling.

    python -m benchmarks throughput [--requests 64] [--model tiny|small|real] [--out bench_out/]
        [--vllm-python /tmp/vllm-venv/bin/python] [--vllm-settings documented,out-of-the-box,best]

Systems, in one process run: aioengine (every request submitted at once; read as ``--offline-outputs`` says,
by default one output each at its end and token ids only, as vLLM's ``LLM.generate`` runs here), vLLM's CPU engine under
named settings (vllm_cpu.py; only with ``--vllm-python`` or ``AIOENGINE_VLLM_PYTHON``), HF
``generate`` in static left-padded batches of 8, 32 and 64, and HF's own continuous batching, each
run ``--repeats`` times (default 3; a shared machine is noisy) and reported by its median run. vLLM's
runs alternate with aioengine's (an aioengine run, then one of every vLLM setting, and again); HF's
come after. Each aioengine repeat's steps are replayed on the worker right after it (its engine efficiency); then
the GEMM-only floor of the median repeat's steps (floors.py) and aioengine
online under Poisson arrivals at three shares of its offline request rate. The FLOP ceiling
(ceiling.py: the workload's FLOPs at the fp32 GEMM peak measured first) gives every system's share. Before each
system's every repeat a GEMM in a helper process says how fast the host is right then (host_speed.py: a shared
host's speed comes in spells).
Workload and models: workload.py. Writes a markdown table to stdout, and JSON + PNG under --out.
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
from typing import Any

import torch
import transformers

from aioengine import AsyncEngine
from benchmarks import hf_baselines, report, vllm_cpu
from benchmarks.ceiling import Ceiling, ceiling, measure_gemm_peak_apart
from benchmarks.engine_run import EngineRun, engine_config, run_offline
from benchmarks.floors import measure_floors, replay_run
from benchmarks.host_speed import HostSpeed
from benchmarks.online import serve_poisson
from benchmarks.results import Floors, OnlineResult, SystemResult, median, spread_note
from benchmarks.workload import DEFAULT_CACHE, MODELS, BenchRequest, checkpoint, output_tokens, vocab_size, workload


def log(message: str) -> None:
    """Progress on stderr, so stdout holds only the report."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def run_engine(
    path: Path,
    reqs: list[BenchRequest],
    args: argparse.Namespace,
    vllm_runs: list[vllm_cpu.VllmRun],
) -> tuple[EngineRun, list[EngineRun], Floors | None, list[OnlineResult], dict[str, list[float]]]:
    """One engine for the offline run (the median repeat, then every repeat), its floors, then the online rates
    (which need the offline rate).

    Each offline repeat's steps are replayed right after it. Then every started vLLM setting runs once (aioengine
    idle meanwhile), so a slow spell of the machine falls on both sides. Also returns the host's speed just before
    each system's every repeat (``HostSpeed``)."""
    config = engine_config(path, reqs, args.max_num_seqs, args.max_batched_tokens)
    speeds: dict[str, list[float]] = {"aioengine": [], **{vllm.name: [] for vllm in vllm_runs}}
    start = time.perf_counter()
    async with AsyncEngine(config) as engine:
        startup = time.perf_counter() - start
        runs = []
        with HostSpeed() as host:
            for _ in range(args.repeats):
                speeds["aioengine"].append(await asyncio.to_thread(host.probe))
                run = await run_offline(engine, reqs, args.offline_outputs)
                # Its steps again at once, in the spell the run had (floors.py): the engine's own share of it.
                run = dataclasses.replace(run, replay=tuple(await replay_run(engine, run.steps)))
                runs.append(run)
                log(
                    f"aioengine: {run.result.tokens_per_s:.1f} tok/s, {run.num_steps} steps in {run.wall:.2f}s, "
                    f"replayed in {sum(run.replay):.2f}s (host {speeds['aioengine'][-1]:.0f} GFLOP/s)"
                )
                for vllm in vllm_runs:
                    speeds[vllm.name].append(await asyncio.to_thread(host.probe))
                    if (line := await asyncio.to_thread(vllm.run)) is not None:
                        log(
                            f"{vllm.name}: {line['tokens_per_s']:.1f} tok/s in {line['seconds']:.2f}s "
                            f"(host {speeds[vllm.name][-1]:.0f} GFLOP/s)"
                        )
        run = median(runs, lambda r: r.wall)
        spread = with_spread(run.result, [r.result for r in runs])
        run = dataclasses.replace(run, result=dataclasses.replace(spread, startup_seconds=startup))
        floors = await measure_floors(engine, run.steps, list(run.replay))
        if floors is not None:
            log(f"floors: replay {floors.replay_seconds:.2f}s, GEMMs {floors.gemm_seconds:.2f}s")
        online = []
        offline_rps = len(reqs) / run.wall
        for fraction in args.rates if args.online_requests else []:
            result = await serve_poisson(engine, reqs[: args.online_requests], offline_rps * fraction, fraction)
            log(f"online at {fraction:.0%}: TTFT p50 {result.ttft_p50 or 0:.3f}s, ITL p50 {result.itl_p50 or 0:.4f}s")
            online.append(result)
    return run, runs, floors, online, speeds


def start_vllm(path: Path, reqs: list[BenchRequest], args: argparse.Namespace) -> list[vllm_cpu.VllmRun]:
    """Every asked-for vLLM setting started (one at a time, before aioengine, so each start-up is timed
    alone) and left stopped until its runs; none when no vLLM python was given."""
    python = vllm_cpu.vllm_python(args.vllm_python)
    if python is None:
        log(f"vLLM CPU: skipped (no --vllm-python, no {vllm_cpu.PYTHON_ENV})")
        return []
    if (problem := vllm_cpu.check_python(python)) is not None:
        log(f"vLLM CPU: skipped ({problem})")
        return []
    runs = vllm_cpu.prepare(
        python, path, reqs, args.vllm_settings, args.max_num_seqs, args.max_batched_tokens, args.out / "vllm_logs"
    )
    for vllm in runs:
        log(f"{vllm.name}: starting ({' '.join(f'{k}={v}' for k, v in vllm.env.items())})")
        if vllm.start():
            log(f"{vllm.name}: ready, start-up {vllm.startup_seconds:.1f}s")
        else:
            log(f"{vllm.name}: {vllm.error}")
    return runs


def measure_ceiling(path: Path, reqs: list[BenchRequest]) -> Ceiling:
    """The GEMM peak on torch's threads now (nothing else of ours running; in a process of its own), and the
    workload's FLOPs."""
    result = ceiling(path, reqs, measure_gemm_peak_apart())
    log(
        f"ceiling: GEMM peak {result.peak.flops_per_s / 1e9:.1f} GFLOP/s, "
        f"{result.tokens_per_s:.0f} tok/s ({result.tokens_per_s_without_attention:.0f} without attention)"
    )
    return result


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


def with_spread(chosen: SystemResult, runs: list[SystemResult]) -> SystemResult:
    """``chosen`` with a note of how its repeats spread, when there were several."""
    spread = spread_note([r.tokens_per_s for r in runs if r.tokens_per_s is not None])
    if spread is None:
        return chosen
    return dataclasses.replace(chosen, note="; ".join(n for n in (chosen.note, spread) if n))


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _settings(text: str) -> list[str]:
    """Setting names; "out-of-the-box" (or with underscores) spares the shell's quotes."""
    names = [" ".join(x.replace("-", " ").replace("_", " ").split()) for x in text.split(",") if x.strip()]
    if unknown := [n for n in names if n not in vllm_cpu.SETTINGS]:
        raise argparse.ArgumentTypeError(f"unknown {unknown}: choose from {', '.join(vllm_cpu.SETTINGS)}")
    return names


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
    parser.add_argument(
        "--offline-outputs",
        choices=["final_only", "stream"],
        default="final_only",
        help="how aioengine's offline run reads its requests: one output at the end, token ids only (as vLLM's "
        "LLM.generate runs here), or streamed and detokenized",
    )
    parser.add_argument("--hf-batch-sizes", type=_ints, default=[8, 32, 64], help="comma separated; empty: none")
    parser.add_argument("--no-hf-cb", dest="hf_cb", action="store_false", help="skip HF continuous batching")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help=f"python of a venv with vllm-cpu (default: ${vllm_cpu.PYTHON_ENV}; neither: vLLM is skipped)",
    )
    parser.add_argument(
        "--vllm-settings",
        type=_settings,
        default=list(vllm_cpu.SETTINGS),
        help="comma separated, of: documented, out-of-the-box, best (default: all three)",
    )
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
    flop_ceiling = measure_ceiling(path, reqs)
    vllm_runs = start_vllm(path, reqs, args)
    try:
        run, runs, floors, online, speeds = asyncio.run(run_engine(path, reqs, args, vllm_runs))
    finally:
        for vllm in vllm_runs:
            vllm.close()
    systems = [v.result() for v in vllm_runs] + run_hf(path, reqs, args)
    pairs = {v.name: vllm_cpu.pair_ratios([r.result.tokens_per_s or 0.0 for r in runs], v.runs) for v in vllm_runs}

    vllm_version = next((v.ready["vllm"] for v in vllm_runs if v.ready), None)
    title = (
        f"{len(reqs)} requests ({output_tokens(reqs)} output tokens), model {args.model}, float32 CPU, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__}" + (f", vLLM CPU {vllm_version}" if vllm_version else "")
    )
    print(report.markdown(title, run, systems, floors, online, flop_ceiling, pairs, speeds, runs))
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
        "vllm": [v.describe() for v in vllm_runs],
        "python": platform.python_version(),
        "machine": platform.machine(),
        "unix_time": time.time(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"throughput_{args.model}"
    report.write_json(stem.with_suffix(".json"), meta, run, systems, floors, online, flop_ceiling, pairs, speeds, runs)
    plotted = report.write_plot(stem.with_suffix(".png"), title, run, systems, online)
    written = f"{stem}.json" + (f" and {stem}.png" if plotted else "")
    print(f"\nwrote {written} ({time.perf_counter() - started:.0f}s in all)")
    if not plotted:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
