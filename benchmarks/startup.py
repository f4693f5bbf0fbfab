"""Start-up: seconds from ``AsyncEngine(...)`` to the first token, cold and warm.

    python -m benchmarks startup [--model real|small|tiny] [--repeats 3]

Each repeat is a fresh Python process (the page cache warm, and the C++ kernels' build cached, as on
any start after the first): "cold" is its first engine, from ``AsyncEngine(config)`` through
``start()`` to the first token of a one-token request; "warm" is a second engine of the same
checkpoint built in the same process after the first shut down (modules imported, kernels loaded).
Time spent before ``AsyncEngine(...)`` (``import aioengine``, finding the model) is reported apart.
The engine's own log lines say where the time went (model load, warm-up). Reported: the median of
the repeats and each repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks.workload import MODELS, checkpoint

CHILD = """
import time
start = time.perf_counter()
import asyncio, json, sys
from aioengine import AsyncEngine, EngineConfig, SamplingParams
imported = time.perf_counter() - start

async def first_token(path):
    begin = time.perf_counter()
    config = EngineConfig(model={"path": path, "dtype": "float32"}, device={"device": "cpu"})
    async with AsyncEngine(config) as engine:
        ready = time.perf_counter() - begin
        async for _ in engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=1, temperature=0)):
            pass
        return ready, time.perf_counter() - begin

cold_ready, cold = asyncio.run(first_token(sys.argv[1]))
warm_ready, warm = asyncio.run(first_token(sys.argv[1]))
print(json.dumps(dict(imported=imported, cold_ready=cold_ready, cold=cold, warm_ready=warm_ready, warm=warm)))
"""


def run_once(path: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="real")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = str(checkpoint(args.model))
    run_once(path)  # builds the kernels and fills the page cache if this machine has not yet
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        runs.append(run_once(path))
        print(f"[startup] process in {time.perf_counter() - start:.1f}s: {runs[-1]}", file=sys.stderr)
    print(f"model {args.model}, {args.repeats} fresh processes (median, then each):\n")
    print("| what | seconds | each |")
    print("|---|---:|---|")
    rows = [
        ("import aioengine (before AsyncEngine)", "imported"),
        ("cold: AsyncEngine(...) to ready", "cold_ready"),
        ("cold: AsyncEngine(...) to the first token", "cold"),
        ("warm (second engine, same process): to ready", "warm_ready"),
        ("warm: to the first token", "warm"),
    ]
    for label, key in rows:
        values = [r[key] for r in runs]
        print(f"| {label} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")


if __name__ == "__main__":
    main()
