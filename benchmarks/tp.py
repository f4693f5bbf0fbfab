"""Tensor parallelism on one host: the throughput workload at TP=1 and TP=2, both on the mp executor.

    python -m benchmarks tp [--requests 64] [--model tiny|small] [--repeats 3] [--threads-per-rank N]

Both sizes run through ``distributed_executor_backend="mp"`` (TP=1 as one rank process), so the process
overhead is the same and only the sharding differs. The sizes alternate, a fresh engine every run, and
each is reported by its median run. Each rank gets ``cores // tp`` torch threads unless
``--threads-per-rank`` says otherwise, so both sizes use the same cores; the table shows what each rank
ran with, read back from the rank. The workload is the throughput benchmark's (workload.py): every
request submitted at once, greedy, EOS ignored.

Beside tokens/s: the communication share, the seconds a rank spent in its collectives (all-reduce,
all-gather, broadcast; ``worker.tp.stats``) over the wall seconds of the timed run, averaged over the
ranks, and the collective calls per engine step. On CPU (gloo) a collective's seconds include waiting
for the slower rank, not only moving bytes. TP only pays where each rank has cores (or a GPU) of its
own; on a small shared CPU it is expected to be slower, and the ratio says by how much.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aioengine import AsyncEngine, EngineConfig
from benchmarks.cpu_load import CpuLoad
from benchmarks.engine_run import engine_config, stream_tokens
from benchmarks.report import table
from benchmarks.throughput import log, median
from benchmarks.workload import DEFAULT_CACHE, BenchRequest, checkpoint, output_tokens, vocab_size, workload

SIZES = (1, 2)


@dataclass(frozen=True, slots=True)
class RankCounters:
    """One rank's counters at one moment: collectives (calls, seconds), its process CPU seconds, threads."""

    calls: int
    collective_seconds: float
    cpu_seconds: float
    threads: int


@dataclass(frozen=True, slots=True)
class TPRun:
    """One timed run of one tensor-parallel size."""

    tp: int
    tokens_per_s: float
    wall: float
    num_steps: int
    calls: tuple[int, ...]
    """Collective calls per rank during the timed run."""
    collective_seconds: tuple[float, ...]
    """Seconds each rank spent in collectives during the timed run."""
    threads: tuple[int, ...]
    """torch threads of each rank."""
    others: float | None
    """Cores busy outside this benchmark (its own process and its ranks) during the run."""

    @property
    def comm_share(self) -> float:
        return statistics.fmean(self.collective_seconds) / self.wall

    @property
    def calls_per_step(self) -> float:
        return statistics.fmean(self.calls) / max(1, self.num_steps)


def reset_collectives(worker: Any) -> None:
    """Zeroes this rank's collective counters (``worker.tp`` is frozen; its stats are not)."""
    worker.tp.stats.calls = 0
    worker.tp.stats.seconds = 0.0


def rank_counters(worker: Any) -> RankCounters:
    """This rank's counters now; runs in the rank's process (``collective_rpc``)."""
    stats = worker.tp.stats
    return RankCounters(stats.calls, stats.seconds, time.process_time(), torch.get_num_threads())


def config_for(path: Path, reqs: list[BenchRequest], args: argparse.Namespace, tp: int) -> EngineConfig:
    """The throughput benchmark's engine (float32 CPU, a cache that holds every request), on ``tp`` mp ranks."""
    base = engine_config(path, reqs, args.max_num_seqs, args.max_batched_tokens)
    threads = args.threads_per_rank or max(1, (os.cpu_count() or 1) // tp)
    return base.model_copy(
        update={
            "parallel": base.parallel.model_copy(
                update={"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}
            ),
            "device": base.device.model_copy(update={"num_threads": threads}),
        }
    )


async def timed_run(config: EngineConfig, reqs: list[BenchRequest]) -> TPRun:
    """A fresh engine: one untimed warm-up request, counters reset, then every request at once."""
    tp = config.parallel.tensor_parallel_size
    async with AsyncEngine(config) as engine:
        await stream_tokens(engine, BenchRequest(reqs[0].prompt[:16], 2))
        await engine.collective_rpc(reset_collectives)
        before: list[RankCounters] = await engine.collective_rpc(rank_counters)
        steps = engine.stats().num_steps
        with CpuLoad() as load:
            start = time.perf_counter()
            counts = await asyncio.gather(*(stream_tokens(engine, r) for r in reqs))
            wall = time.perf_counter() - start
        steps = engine.stats().num_steps - steps
        after: list[RankCounters] = await engine.collective_rpc(rank_counters)
    if counts != [r.max_tokens for r in reqs]:
        raise RuntimeError(f"TP={tp}: some requests got a different token count than they asked for")
    ranks_cpu = sum(a.cpu_seconds - b.cpu_seconds for a, b in zip(after, before, strict=True))
    return TPRun(
        tp=tp,
        tokens_per_s=output_tokens(reqs) / wall,
        wall=wall,
        num_steps=steps,
        calls=tuple(a.calls for a in after),
        collective_seconds=tuple(a.collective_seconds for a in after),
        threads=tuple(a.threads for a in after),
        others=None if load.others is None else max(0.0, load.others - ranks_cpu / wall),
    )


def cores(others: float | None) -> str:
    return "-" if others is None else f"{others:.2f}"


def row(run: TPRun, base: TPRun, repeats: list[TPRun]) -> list[str]:
    """One size's line of the table: its median run beside TP=1's, then every repeat's tokens/s and other load."""
    return [
        f"{run.tp}",
        f"{run.tokens_per_s:.1f}",
        f"{run.tokens_per_s / base.tokens_per_s:.2f}x",
        f"{run.wall:.2f}",
        f"{run.num_steps}",
        f"{run.comm_share:.2f}",
        f"{run.calls_per_step:.1f}",
        " / ".join(map(str, run.threads)),
        cores(run.others),
        ", ".join(f"{r.tokens_per_s:.0f} ({cores(r.others)})" for r in repeats),
    ]


def report(runs: dict[int, list[TPRun]], title: str) -> list[str]:
    """The median run of each size, and TP=2 over TP=1 per repeat (the pairs ran next to each other)."""
    chosen = {tp: median(repeats, lambda r: r.wall) for tp, repeats in runs.items()}
    head = ["TP", "output tokens/s", "vs TP=1", "seconds", "steps", "comm share", "collective calls / step"]
    head += ["threads per rank", "other load (cores)", "each repeat: tok/s (other load)"]
    rows = [row(run, chosen[1], runs[tp]) for tp, run in chosen.items()]
    pairs = ", ".join(f"{b.tokens_per_s / a.tokens_per_s:.2f}" for a, b in zip(runs[1], runs[2], strict=True))
    return [title, "", *table(head, rows), "", f"TP=2 / TP=1 per repeat: {pairs}"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks tp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64, help="requests per run (a prefix of the fixed 64)")
    parser.add_argument(
        "--model", choices=["tiny", "small"], default="tiny", help="'real' has 9 heads: TP=2 cannot split them"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each size, alternated; the median is reported")
    parser.add_argument("--threads-per-rank", type=int, help="torch threads of each rank; default cores // tp")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where built checkpoints are kept")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    path = checkpoint(args.model, args.cache)
    reqs = workload(args.requests, vocab_size(args.model))
    log(f"model {args.model} at {path}; {len(reqs)} requests, {output_tokens(reqs)} output tokens")
    runs: dict[int, list[TPRun]] = {tp: [] for tp in SIZES}
    for repeat in range(args.repeats):
        for tp in SIZES:
            run = asyncio.run(timed_run(config_for(path, reqs, args, tp), reqs))
            runs[tp].append(run)
            log(
                f"repeat {repeat + 1}, TP={tp}: {run.tokens_per_s:.1f} tok/s, {run.num_steps} steps in "
                f"{run.wall:.2f}s, comm share {run.comm_share:.2f}, threads {run.threads}, "
                f"other load {cores(run.others)} cores"
            )
    title = (
        f"{len(reqs)} requests ({output_tokens(reqs)} output tokens), model {args.model}, float32 CPU, mp executor, "
        f"{os.cpu_count()} cores, median of {args.repeats} alternated runs, torch {torch.__version__}"
    )
    print("\n".join(report(runs, title)))
    print(f"\n({time.perf_counter() - started:.0f}s in all)")


if __name__ == "__main__":
    main()
