"""Sleep and wake seconds per level, beside a plain host memcpy of the same bytes (the floor).

    python -m benchmarks.sleep_wake [--num-blocks 8192] [--device cpu]

Both measured in the same run. On CPU level 1 frees only the KV cache (weights live in host
memory already), so its floor is freeing + re-touching that many bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch

from aioengine import AsyncEngine, EngineConfig, SamplingParams
from aioengine.testing import build_checkpoint

SPEC = dict(hidden_size=512, intermediate_size=1376, num_layers=8, num_heads=8, num_kv_heads=4, vocab_size=32000)


def memcpy_seconds(nbytes: int, device: str) -> float:
    """Copy ``nbytes`` from the device to host and back, as a sleep + wake at level 1 must."""
    if nbytes == 0:
        return 0.0
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    pin = device != "cpu"
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
    start = time.perf_counter()
    host.copy_(src)
    back = torch.empty_like(src)
    back.copy_(host)
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start


async def run(path: Path, device: str, num_blocks: int) -> list[tuple[str, float, float, int]]:
    config = EngineConfig(model={"path": str(path)}, device={"device": device}, cache={"num_blocks": num_blocks})
    rows = []
    async with AsyncEngine(config) as engine:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        async for _ in engine.generate([5, 6, 7], params):
            pass
        for level in (1, 2):
            slept = await engine.sleep(level)
            woke = await engine.wake_up()
            wake_seconds = woke.seconds
            if level == 2:
                wake_seconds += (await engine.reload_weights()).seconds
            rows.append((f"level {level}", slept.seconds, wake_seconds, slept.freed_bytes.total))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "model", "llama", **SPEC)  # type: ignore[arg-type]
        rows = asyncio.run(run(path, args.device, args.num_blocks))
    print(f"\ndevice {args.device}, KV cache {args.num_blocks} blocks\n")
    print("| level | bytes freed | sleep s | wake s (+ reload for level 2) | memcpy floor s (out + back) |")
    print("|---|---:|---:|---:|---:|")
    for name, sleep_s, wake_s, nbytes in rows:
        print(
            f"| {name} | {nbytes / 2**20:.1f} MiB | {sleep_s:.3f} | {wake_s:.3f} "
            f"| {memcpy_seconds(nbytes, args.device):.3f} |"
        )


if __name__ == "__main__":
    main()
