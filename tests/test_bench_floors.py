"""The throughput benchmark's floors on a served engine (untimed: only that they run and cover the steps)."""

from __future__ import annotations

from aioengine import AsyncEngine, SamplingParams
from benchmarks.floors import gemm_steps
from tests.helpers import final


async def test_the_gemm_floor_runs_the_served_layers_whatever_holds_their_weights(llama_engine: AsyncEngine) -> None:
    # On CPU a served layer's weight may be a meta placeholder (its packed copy is its one store): the
    # floor's inputs must come from the runner, not from the weights.
    await final(llama_engine, [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    seconds = await llama_engine.collective_rpc(gemm_steps, ([(7, 1), (3, 3)],), unique_reply_rank=0)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
