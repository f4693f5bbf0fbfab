"""GPU check: CUDA-graph capture time, decode step time eager vs graph, greedy parity graph vs eager,
per sleep level: device memory freed, sleep/wake seconds, outputs and graph replay after wake, and one
preemption of a 1,500-token context both ways: recompute (its prefill) vs swap to pinned host memory.

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
from pathlib import Path

import torch

from aioengine import AsyncEngine, EngineConfig, SamplingParams
from aioengine.messages import KVCacheConfig
from aioengine.testing import build_checkpoint
from aioengine.worker.gpu_worker import CUDAWorker
from aioengine.worker.graphs import PaddedDecodeRunner
from benchmarks.preemption import preemption_costs

BATCHES = (1, 8, 32)
SPEC = dict(hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=4)


def config(path: Path, eager: bool, preemption_mode: str = "recompute") -> EngineConfig:
    return EngineConfig(
        model={"path": str(path), "dtype": "float32", "max_model_len": 1024},
        device={"device": "cuda"},
        cache={"num_blocks": 2048},
        scheduler={"max_num_seqs": 32, "preemption_mode": preemption_mode},
        compile={"enforce_eager": eager, "cuda_graph_sizes": list(BATCHES)},
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


def _eager_decode(
    decode: PaddedDecodeRunner, ids: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor, b: int
) -> None:
    with torch.inference_mode():
        decode._fill(ids, pos, tables, b)
        decode._forward(b, decode.max_blocks)


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
        tables = torch.arange(1, 1 + b * blocks, device="cuda").view(b, blocks)
        ids = torch.randint(3, 500, (b,), device="cuda")
        pos = torch.full((b,), ctx, device="cuda")
        graph_ms = _timed(functools.partial(decode.run, ids, pos, tables))
        out[b] = (_timed(functools.partial(_eager_decode, decode, ids, pos, tables, b)), graph_ms)
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


async def greedy(path: Path, eager: bool, prompts: list[list[int]]) -> list[list[int]]:
    async with AsyncEngine(config(path, eager)) as engine:
        return await greedy_outputs(engine, prompts, 32)


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
        eager_tokens = asyncio.run(greedy(path, True, prompts))
        graph_tokens = asyncio.run(greedy(path, False, prompts))
        sleep_rows = asyncio.run(sleep_check(path, prompts[:8]))
        sleep_rows += asyncio.run(swap_check(path))
    same = sum(a == b for a, b in zip(eager_tokens, graph_tokens, strict=True))
    print(f"\n{torch.cuda.get_device_name()} · torch {torch.__version__} · Llama h1024 x 8 layers, float32\n")
    print("| measure | value |\n|---|---|")
    print(f"| graph capture ({len(BATCHES)} sizes) | {capture:.2f} s |")
    for b, (eager_ms, graph_ms) in times.items():
        print(
            f"| decode step, batch {b} (eager / graph) "
            f"| {eager_ms:.2f} ms / {graph_ms:.2f} ms ({eager_ms / graph_ms:.1f}x) |"
        )
    print(f"| greedy parity graph vs eager (24 prompts x 32 tokens) | {same}/{len(prompts)} identical |")
    for name, value in sleep_rows:
        print(f"| {name} | {value} |")
    sleep_ok = all(not name.endswith("graphs live") or value.startswith("True") for name, value in sleep_rows)
    return 0 if same == len(prompts) and sleep_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
