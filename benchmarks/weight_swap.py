"""Hot weight swap seconds, and the pause streams saw, beside reading the same bytes from disk.

    python -m benchmarks.weight_swap [--device cpu] [--streams 4] [--keep DIR]

Two random-init Llama checkpoints of the same shape (A and B, ~560 MB of float32 each). An engine
serves A while a few greedy streams run; ``update_weights`` swaps B in (mode "pause"), then A
again with ``stage=True`` (read and checked while serving, so the pause covers only the copy), then B
from a dict of tensors in memory (what an RL trainer in the same process hands over).
Beside them, in the same run and with the page cache warmed by a first read: reading the same
files' bytes, and ``safetensors.torch.load_file`` + ``copy_`` into preallocated tensors (a swap's
work without the engine): the floors a swap from disk cannot beat.

"Pause in report" runs from the swap's request to pause (it waits for the step in flight) to the
resume. "Longest stream gap" is the longest wait between two outputs of one stream that overlaps
the whole update (staging included); the steady gap (one decode step) is printed for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from aioengine import AsyncEngine, EngineConfig, SamplingParams
from aioengine.engine.control import WeightUpdateReport
from aioengine.model.loader import checkpoint_files
from aioengine.testing import build_checkpoint

SPEC = dict(hidden_size=1024, intermediate_size=2048, num_layers=8, num_heads=16, num_kv_heads=8, vocab_size=32000)
PROMPT = list(range(10, 42))


@dataclass
class Streams:
    """A few greedy streams, each restarted when it ends; every output's arrival time is kept."""

    stamps: list[tuple[float, float]] = field(default_factory=list)
    stop: bool = False

    async def run(self, engine: AsyncEngine, num: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

        async def one(i: int) -> None:
            while not self.stop:
                last = time.perf_counter()
                async for _ in engine.generate([i + 3, *PROMPT], params):
                    now = time.perf_counter()
                    self.stamps.append((last, now))
                    last = now

        await asyncio.gather(*(one(i) for i in range(num)))

    def gaps_within(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive outputs of one stream that overlap [start, end]."""
        return [b - a for a, b in self.stamps if b >= start and a <= end]


def best_of(fn: Any, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def disk_floors(path: Path) -> tuple[float, float, int]:
    """Seconds to read the checkpoint's files, and to load them into tensors, with the page cache warm.

    ``load_file`` maps the file lazily, so its tensors are copied into preallocated ones (as a swap
    copies into the parameters) to make it read every byte.
    """
    files = checkpoint_files(path)
    buffers = [bytearray(f.stat().st_size) for f in files]
    targets = [{n: t.clone() for n, t in load_file(str(f)).items()} for f in files]  # also warms the page cache

    def read_bytes() -> None:
        for f, buf in zip(files, buffers, strict=True):
            with open(f, "rb", buffering=0) as handle:
                handle.readinto(buf)

    def load_and_copy() -> None:
        for f, dst in zip(files, targets, strict=True):
            for name, tensor in load_file(str(f)).items():
                dst[name].copy_(tensor)

    nbytes = sum(t.numel() * t.element_size() for dst in targets for t in dst.values())
    return best_of(read_bytes), best_of(load_and_copy), nbytes


async def swap(engine: AsyncEngine, streams: Streams, source: Any, **kwargs: Any) -> tuple[WeightUpdateReport, float]:
    """The update's report and the longest gap between two outputs of any stream while it ran."""
    start = time.perf_counter()
    report = await engine.update_weights(source, **kwargs)
    end = time.perf_counter()
    gap = max(streams.gaps_within(start, end), default=float("nan"))
    await asyncio.sleep(0.5)  # let the streams settle before the next measurement
    return report, gap


async def run(
    a: Path, b: Path, device: str, num_streams: int
) -> tuple[float, list[tuple[str, tuple[WeightUpdateReport, float]]]]:
    config = EngineConfig(model={"path": str(a)}, device={"device": device}, cache={"num_blocks": 256})
    async with AsyncEngine(config) as engine:
        streams = Streams()
        load = asyncio.create_task(streams.run(engine, num_streams, max_tokens=32))
        await asyncio.sleep(1.5)
        quiet_start = time.perf_counter()
        await asyncio.sleep(1.0)
        steady = statistics.median(streams.gaps_within(quiet_start, time.perf_counter()))
        in_memory = {n: t.clone() for f in checkpoint_files(b) for n, t in load_file(str(f)).items()}
        rows = [
            ('update_weights(B, mode="pause")', await swap(engine, streams, b, mode="pause")),
            ('update_weights(A, mode="pause", stage=True)', await swap(engine, streams, a, mode="pause", stage=True)),
            ('update_weights({B as tensors in memory}, mode="pause")', await swap(engine, streams, in_memory)),
        ]
        streams.stop = True
        await load
    return steady, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--streams", type=int, default=4, help="concurrent greedy streams during the swaps")
    parser.add_argument("--keep", type=Path, default=None, help="build the checkpoints here and reuse them next run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        start = time.perf_counter()
        a = build_checkpoint(root / "swap-a", "llama", seed=0, **SPEC)  # type: ignore[arg-type]
        b = build_checkpoint(root / "swap-b", "llama", seed=1, **SPEC)  # type: ignore[arg-type]
        print(f"checkpoints ready in {time.perf_counter() - start:.1f}s")
        read_s, load_s, nbytes = disk_floors(b)
        steady, rows = asyncio.run(run(a, b, args.device, args.streams))
    print(
        f"\ndevice {args.device}, {nbytes / 2**20:.0f} MiB of float32 weights, {args.streams} greedy streams "
        f"running (steady gap between outputs: {steady * 1e3:.0f} ms)\n"
    )
    print("| what | tensors | seconds | GB/s | pause in report s | longest stream gap during it s |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| read the same files' bytes (page cache warm) | - | {read_s:.3f} | {nbytes / read_s / 1e9:.2f} | - | - |")
    print(
        f"| load_file + copy_ into tensors, no engine (page cache warm) | - | {load_s:.3f} "
        f"| {nbytes / load_s / 1e9:.2f} | - | - |"
    )
    for name, (r, gap) in rows:
        print(
            f"| {name} | {r.tensors} | {r.seconds:.3f} | {r.bytes / r.seconds / 1e9:.2f} "
            f"| {r.pause_seconds:.3f} | {gap:.3f} |"
        )


if __name__ == "__main__":
    main()
