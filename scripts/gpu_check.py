"""GPU check: CUDA-graph capture time, decode step time eager vs graph, greedy parity graph vs eager,
per sleep level: device memory freed, sleep/wake seconds, outputs and graph replay after wake, one
preemption of a 1,500-token context both ways: recompute (its prefill) vs swap to pinned host memory, and
tensor parallelism over the mp executor: TP=1 (greedy tokens equal to the thread backend's, tokens/s) and,
on a machine with two or more GPUs, TP=2 (greedy parity with TP=1, tokens/s, communication share).

Run through scripts/gpu_check.sh on a CUDA machine. Prints a markdown table; exits non-zero if
parity fails. Uses a locally built random-init Llama (float32, so parity is exact).
"""

from __future__ import annotations

import asyncio
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aioengine import AsyncEngine, EngineConfig, SamplingParams
from aioengine.messages import KVCacheConfig, ScheduledRequest
from aioengine.testing import build_checkpoint
from aioengine.worker.gpu_worker import CUDAWorker
from aioengine.worker.graphs import PaddedDecodeRunner
from aioengine.worker.step_inputs import DecodeBatch, padded_decode_inputs
from benchmarks.preemption import preemption_costs
from benchmarks.tp import RankCounters, rank_counters, reset_collectives

BATCHES = (1, 8, 32)
SPEC = dict(hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=4)


def config(
    path: Path, eager: bool, preemption_mode: str = "recompute", parallel: dict[str, Any] | None = None
) -> EngineConfig:
    return EngineConfig(
        model={"path": str(path), "dtype": "float32", "max_model_len": 1024},
        device={"device": "cuda"},
        cache={"num_blocks": 2048},
        scheduler={"max_num_seqs": 32, "preemption_mode": preemption_mode},
        compile={"enforce_eager": eager, "cuda_graph_sizes": list(BATCHES)},
        parallel=parallel or {},
    )


def _timed(fn: Callable[[], object], n: int = 50) -> float:
    """Milliseconds per call of ``fn``, after 5 untimed warm-up calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def _eager_decode(decode: PaddedDecodeRunner, batch: DecodeBatch) -> None:
    with torch.inference_mode():
        decode._fill(batch, batch.size)
        decode._forward(batch.size, decode.max_blocks)


def step_times(path: Path) -> tuple[float, dict[int, tuple[float, float]]]:
    worker = CUDAWorker(config(path, eager=False))
    worker.init_device()
    worker.load_model()
    worker.initialize_from_config(KVCacheConfig(num_cache_blocks=2048, block_size=16))
    runner = worker.model_runner
    assert runner is not None and runner.decode_runner is not None
    capture = runner.capture_model()
    decode = runner.decode_runner
    out: dict[int, tuple[float, float]] = {}
    for b in BATCHES:
        ctx = 300  # tokens already in the cache per sequence
        blocks = -(-(ctx + 1) // 16)
        reqs = [
            ScheduledRequest(f"r{i}", [3 + i % 497], ctx, list(range(1 + i * blocks, 1 + (i + 1) * blocks)), None)
            for i in range(b)
        ]
        batch = padded_decode_inputs(reqs, torch.device("cuda"), decode_kernel=None, block_size=16)
        graph_ms = _timed(functools.partial(decode.run, batch))
        out[b] = (_timed(functools.partial(_eager_decode, decode, batch)), graph_ms)
    worker.shutdown()
    return capture, out


async def greedy_outputs(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def one(p: list[int]) -> list[int]:
        last = None
        async for o in engine.generate(p, params):
            last = o
        assert last is not None
        return last.token_ids

    return list(await asyncio.gather(*(one(p) for p in prompts)))


@dataclass(frozen=True, slots=True)
class TimedGreedy:
    """One engine's greedy tokens for every prompt, all submitted at once, and what the run cost."""

    tokens: list[list[int]]
    tokens_per_s: float
    comm_share: float
    """Seconds in collectives per rank over the run's wall seconds (NCCL: the host's wait only)."""
    calls_per_step: float


async def timed_greedy(cfg: EngineConfig, prompts: list[list[int]], max_tokens: int = 32) -> TimedGreedy:
    """A fresh engine of ``cfg``: one untimed warm-up request, the collective counters reset, then the prompts."""
    async with AsyncEngine(cfg) as engine:
        await greedy_outputs(engine, [[1, 2, 3]], 2)  # warm-up, untimed; under one block, so nothing is cached
        await engine.collective_rpc(reset_collectives)
        steps = engine.stats().num_steps
        start = time.perf_counter()
        tokens = await greedy_outputs(engine, prompts, max_tokens)
        wall = time.perf_counter() - start
        steps = engine.stats().num_steps - steps
        ranks: list[RankCounters] = await engine.collective_rpc(rank_counters)
    seconds = sum(r.collective_seconds for r in ranks) / len(ranks)
    calls = sum(r.calls for r in ranks) / len(ranks)
    return TimedGreedy(tokens, len(prompts) * max_tokens / wall, seconds / wall, calls / max(1, steps))


async def tp_check(
    path: Path, prompts: list[list[int]], eager: TimedGreedy, graph: TimedGreedy
) -> tuple[list[tuple[str, str]], bool]:
    """TP=1 through the mp executor against the thread executor's ``graph`` run; on two GPUs, TP=2 against it.

    TP=2 decodes eagerly (graphs are not captured under tensor parallelism yet), so its tokens/s compare
    with the thread executor's ``eager`` run; its tokens with TP=1's (graph and eager tokens are equal)."""
    one = await timed_greedy(config(path, eager=False, parallel={"distributed_executor_backend": "mp"}), prompts)
    same = sum(a == b for a, b in zip(one.tokens, graph.tokens, strict=True))
    what = f"{len(prompts)} prompts x 32 tokens"
    rows = [
        (f"TP=1 mp vs thread executor: greedy parity ({what})", f"{same}/{len(prompts)} identical"),
        (
            f"TP=1 tokens/s ({what}, at once): thread eager / thread graph / mp graph",
            f"{eager.tokens_per_s:.0f} / {graph.tokens_per_s:.0f} / {one.tokens_per_s:.0f}",
        ),
    ]
    ok = same == len(prompts)
    if torch.cuda.device_count() < 2:
        rows.append(("TP=2 (mp, NCCL)", f"skipped: {torch.cuda.device_count()} CUDA device, needs 2"))
        return rows, ok
    parallel = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    two = await timed_greedy(config(path, eager=False, parallel=parallel), prompts)
    same = sum(a == b for a, b in zip(two.tokens, one.tokens, strict=True))
    rows += [
        (f"TP=2 vs TP=1 (mp, NCCL): greedy parity ({what})", f"{same}/{len(prompts)} identical"),
        (
            "TP=2 tokens/s, eager (vs TP=1 eager)",
            f"{two.tokens_per_s:.0f} ({two.tokens_per_s / eager.tokens_per_s:.2f}x)",
        ),
        (
            "TP=2 comm share (host wait in collectives / wall; NCCL runs async), collective calls per step",
            f"{two.comm_share:.2f}, {two.calls_per_step:.1f}",
        ),
    ]
    return rows, ok and same == len(prompts)


async def sleep_check(path: Path, prompts: list[list[int]]) -> list[tuple[str, str]]:
    """Per level: device memory freed (mem_get_info), sleep/wake seconds, outputs and graphs after wake."""
    rows = []
    async with AsyncEngine(config(path, eager=False)) as engine:
        before = await greedy_outputs(engine, prompts, 16)
        for level in (1, 2):
            torch.cuda.synchronize()
            free0 = torch.cuda.mem_get_info()[0]
            slept = await engine.sleep(level)
            free1 = torch.cuda.mem_get_info()[0]
            woke = await engine.wake_up()
            wake_seconds = woke.seconds
            if level == 2:
                wake_seconds += (await engine.reload_weights()).seconds
            graphs = await engine.collective_rpc(
                lambda w: len(w.model_runner.decode_runner.graphs), unique_reply_rank=0
            )
            same = await greedy_outputs(engine, prompts, 16) == before
            rows.append(
                (
                    f"sleep level {level}: device memory freed",
                    f"{(free1 - free0) / 2**20:.0f} MiB (reported {slept.freed_bytes.total / 2**20:.0f} MiB)",
                )
            )
            rows.append(
                (
                    f"sleep level {level}: sleep / wake s",
                    f"{slept.seconds:.3f} / {wake_seconds:.3f} (graph recapture {woke.graph_capture_seconds:.2f} s)",
                )
            )
            rows.append((f"sleep level {level}: outputs after wake identical, graphs live", f"{same}, {graphs} graphs"))
    return rows


async def swap_check(path: Path) -> list[tuple[str, str]]:
    """One preemption of a 1,000-token context (max_model_len is 1,024): prefill vs pinned swap out + in."""
    swap = config(path, eager=False, preemption_mode="swap")
    context = torch.randint(3, 1000, (1000,), generator=torch.Generator().manual_seed(1)).tolist()
    async with AsyncEngine(swap) as engine:
        pinned = await engine.collective_rpc(
            lambda w: w.model_runner.cache_engine.host_cache[0].is_pinned(), unique_reply_rank=0
        )
        costs = await preemption_costs(engine, context)
    ms = {k: v * 1000 for k, v in costs.items()}
    return [
        (
            f"one preemption of {len(context)} tokens: recompute / swap out + in (pinned: {pinned})",
            f"{ms['recompute']:.2f} ms / {ms['swap_out']:.2f} + {ms['swap_in']:.2f} ms",
        )
    ]


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "llama", "llama", vocab_size=32000, **SPEC)  # type: ignore[arg-type]
        capture, times = step_times(path)
        g = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in torch.randint(1, 200, (24,), generator=g)
        ]
        eager = asyncio.run(timed_greedy(config(path, eager=True), prompts))
        graph = asyncio.run(timed_greedy(config(path, eager=False), prompts))
        sleep_rows = asyncio.run(sleep_check(path, prompts[:8]))
        sleep_rows += asyncio.run(swap_check(path))
        tp_rows, tp_ok = asyncio.run(tp_check(path, prompts, eager, graph))
    same = sum(a == b for a, b in zip(eager.tokens, graph.tokens, strict=True))
    print(f"\n{torch.cuda.get_device_name()} · torch {torch.__version__} · Llama h1024 x 8 layers, float32\n")
    print("| measure | value |\n|---|---|")
    print(f"| graph capture ({len(BATCHES)} sizes) | {capture:.2f} s |")
    for b, (eager_ms, graph_ms) in times.items():
        print(
            f"| decode step, batch {b} (eager / graph) "
            f"| {eager_ms:.2f} ms / {graph_ms:.2f} ms ({eager_ms / graph_ms:.1f}x) |"
        )
    print(f"| greedy parity graph vs eager (24 prompts x 32 tokens) | {same}/{len(prompts)} identical |")
    for name, value in sleep_rows + tp_rows:
        print(f"| {name} | {value} |")
    sleep_ok = all(not name.endswith("graphs live") or value.startswith("True") for name, value in sleep_rows)
    return 0 if same == len(prompts) and sleep_ok and tp_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
