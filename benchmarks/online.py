"""aioengine online: requests arrive as a Poisson process; latency as each client sees it.

TTFT runs from a request's scheduled arrival to its first token; inter-token latency (ITL) is every
gap between two outputs of one stream, divided by the tokens the later output brought. The loop lag
ticker runs from the first arrival to the last token.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from aioengine import AsyncEngine
from benchmarks.cpu_load import CpuLoad
from benchmarks.engine_run import stream_tokens
from benchmarks.loop_lag import LoopLag, percentile
from benchmarks.results import OnlineResult
from benchmarks.workload import BenchRequest, output_tokens


async def serve_poisson(
    engine: AsyncEngine, reqs: list[BenchRequest], rate: float, fraction: float, seed: int = 1
) -> OnlineResult:
    """Submits ``reqs`` in order at exponential gaps of mean ``1 / rate`` seconds."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(reqs)))
    arrivals -= arrivals[0]  # the first request arrives at once
    ttfts: list[float] = []
    itls: list[float] = []

    async def client(req: BenchRequest, arrival: float) -> None:
        await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        last = arrival

        def on_output(new_tokens: int) -> None:
            nonlocal last
            now = time.perf_counter()
            if last == arrival:
                ttfts.append(now - arrival)
            elif new_tokens:
                itls.extend([(now - last) / new_tokens] * new_tokens)
            last = now

        await stream_tokens(engine, req, on_output)

    with CpuLoad() as load:
        async with LoopLag() as lag:
            start = time.perf_counter()
            await asyncio.gather(*(client(r, start + float(a)) for r, a in zip(reqs, arrivals, strict=True)))
            wall = time.perf_counter() - start
    return OnlineResult(
        rate=rate,
        fraction=fraction,
        num_requests=len(reqs),
        tokens_per_s=output_tokens(reqs) / wall,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        loop_lag_p99=lag.p99(),
        others_load=load.others,
    )
