"""Preemption by recompute vs by swap, when long contexts do not all fit in the KV cache.

    python -m benchmarks preemption [--requests 16] [--prompt-len 1500] [--new-tokens 256] [--fits 8]
                                    [--model tiny|small|real] [--repeat 1]

``--requests`` prompts of ``--prompt-len`` random tokens, ``--new-tokens`` greedy tokens each, all
submitted at once, on a KV cache that holds ``--fits`` of them. Three engines one after the other on
the same checkpoint: a cache that holds every request (no preemption: the baseline), then the small
cache with ``scheduler.preemption_mode`` "recompute" and "swap". The small cache also runs fewer
requests at once, which costs both modes alike; what differs between them is what a preemption costs,
so the table gives each mode's extra seconds over the baseline per preemption, and the difference.
How often the scheduler preempts depends on the workload, so the benchmark also times one preemption
directly on an idle engine: recompute is the prefill of the context a preempted request had (prompt
plus half its new tokens), swap is ``CacheEngine.swap_out`` + ``swap_in`` of that many blocks.
On a CPU both caches live in host memory, so a swap is a memcpy of the request's blocks; on CUDA it
crosses PCIe to pinned memory (scripts/gpu_check.py prints the same direct figures on CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aioengine import AsyncEngine, EngineConfig, SamplingParams
from benchmarks.report import table
from benchmarks.throughput import log, median
from benchmarks.workload import DEFAULT_CACHE, MODELS, checkpoint, vocab_size


async def one_run(path: Path, prompts: list[list[int]], new_tokens: int, num_blocks: int, mode: str) -> dict[str, Any]:
    config = EngineConfig(
        model={"path": str(path), "dtype": "float32"},
        device={"device": "cpu"},
        cache={"block_size": 16, "num_blocks": num_blocks, "swap_space_bytes": 1 << 31, "enable_prefix_caching": False},
        scheduler={"max_num_seqs": len(prompts), "max_num_batched_tokens": 2048, "preemption_mode": mode},
    )
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    async with AsyncEngine(config) as engine:

        async def one(prompt: list[int]) -> int:
            count = 0
            async for out in engine.generate(prompt, params):
                count = len(out.token_ids)
            return count

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
        stats = engine.stats()
    assert counts == [new_tokens] * len(prompts)
    return {"seconds": seconds, "preemptions": stats.num_preemptions, "swapped": stats.num_swapped_out}


def _swap_seconds(worker: Any, num_blocks: int, repeat: int) -> tuple[float, float]:
    """Runs on the worker: median seconds of swapping ``num_blocks`` blocks out to the host pool, and in.

    Out first, then in, so the device blocks get back exactly what they held."""
    cache = worker.model_runner.cache_engine
    mapping = {i: i for i in range(num_blocks)}
    cuda = cache.device.type == "cuda"

    def timed(move: Any) -> float:
        times = []
        for _ in range(repeat):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            move(mapping)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    return timed(cache.swap_out), timed(cache.swap_in)


async def preemption_costs(engine: AsyncEngine, context: list[int], repeat: int = 5) -> dict[str, float]:
    """One preemption of a request holding ``context`` tokens, timed both ways on an idle engine:
    ``recompute`` (a prefill of the context, what resuming it costs) and ``swap_out`` / ``swap_in``
    (copies of its blocks to the host pool and back). The engine needs a host pool (swap mode)."""
    block_size = engine.config.cache.block_size
    num_blocks = -(-len(context) // block_size)
    out, back = await engine.collective_rpc(
        functools.partial(_swap_seconds, num_blocks=num_blocks, repeat=repeat), unique_reply_rank=0
    )
    params = SamplingParams(temperature=0, max_tokens=1)
    prefills = []
    for _ in range(repeat):
        await engine.reset_prefix_cache()
        start = time.perf_counter()
        async for _out in engine.generate(context, params):
            pass
        prefills.append(time.perf_counter() - start)
    return {"recompute": sorted(prefills)[repeat // 2], "swap_out": out, "swap_in": back}


async def direct_costs(path: Path, context: list[int], num_blocks: int) -> dict[str, float]:
    config = EngineConfig(
        model={"path": str(path), "dtype": "float32"},
        device={"device": "cpu"},
        cache={"block_size": 16, "num_blocks": num_blocks, "swap_space_bytes": 1 << 30},
        scheduler={"max_num_batched_tokens": 2048, "preemption_mode": "swap"},
    )
    async with AsyncEngine(config) as engine:
        return await preemption_costs(engine, context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--fits", type=int, default=8, help="requests the small cache holds at once")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    path = checkpoint(args.model, args.cache)
    rng = np.random.default_rng(0)
    vocab = vocab_size(args.model)
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.requests)]
    per_request = -(-(args.prompt_len + args.new_tokens) // 16)
    small = args.fits * per_request + 1
    big = args.requests * per_request + 1
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "recompute": [], "swap": []}
    for _ in range(args.repeat):
        systems = (("baseline", big, "recompute"), ("recompute", small, "recompute"), ("swap", small, "swap"))
        for name, blocks, mode in systems:
            result = asyncio.run(one_run(path, prompts, args.new_tokens, blocks, mode))
            log(f"{name}: {result['seconds']:.2f}s, {result['preemptions']} preemptions ({result['swapped']} swapped)")
            runs[name].append(result)
    base = median(runs["baseline"], key=lambda r: r["seconds"])["seconds"]
    rows = []
    for name, results in runs.items():
        run = median(results, key=lambda r: r["seconds"])
        seconds, preemptions = run["seconds"], run["preemptions"]
        cost = (seconds - base) / preemptions if preemptions else None
        rows.append(
            [
                name,
                f"{seconds:.2f}",
                str(preemptions),
                str(run["swapped"]),
                "-" if cost is None else f"{cost * 1000:.0f}",
            ]
        )
    title = (
        f"{args.requests} requests x {args.prompt_len} prompt tokens + {args.new_tokens} new, cache for {args.fits} "
        f"({small - 1} blocks of 16), model {args.model}, float32 CPU, median of {args.repeat}"
    )
    head = ["system", "seconds", "preemptions", "swapped", "ms per preemption (over baseline)"]
    recompute = median(runs["recompute"], key=lambda r: r["seconds"])
    swap = median(runs["swap"], key=lambda r: r["seconds"])
    if swap["swapped"]:
        saved = (recompute["seconds"] - swap["seconds"]) / swap["swapped"]
        verdict = f"swap saves {saved * 1000:.0f} ms per swapped preemption against recompute (negative: it costs more)"
    else:
        verdict = "no request was swapped out in this workload"
    context = prompts[0] + prompts[1][: args.new_tokens // 2]
    direct = asyncio.run(direct_costs(path, context, small))
    swap_ms = (direct["swap_out"] + direct["swap_in"]) * 1000
    measured = (
        f"one preemption of a {len(context)}-token context, timed directly (median of 5): recompute "
        f"{direct['recompute'] * 1000:.1f} ms, swap {swap_ms:.1f} ms (out {direct['swap_out'] * 1000:.2f} + in "
        f"{direct['swap_in'] * 1000:.2f}), {direct['recompute'] * 1000 / swap_ms:.0f}x"
    )
    print("\n".join([title, "", *table(head, rows), "", verdict, measured]))


if __name__ == "__main__":
    main()
