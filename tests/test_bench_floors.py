"""The throughput benchmark's floors on a served engine (untimed: only that they run and cover the steps)."""

from __future__ import annotations

from aioengine import AsyncEngine, SamplingParams
from benchmarks.engine_run import StepRecorder
from benchmarks.floors import gemm_steps, measure_floors, replay_run
from tests.helpers import final


async def test_the_gemm_floor_runs_the_served_layers_whatever_holds_their_weights(llama_engine: AsyncEngine) -> None:
    # On CPU a served layer's weight may be a meta placeholder (its packed copy is its one store): the
    # floor's inputs must come from the runner, not from the weights.
    await final(llama_engine, [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    seconds = await llama_engine.collective_rpc(gemm_steps, ([(7, 1), (3, 3)],), unique_reply_rank=0)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)


async def test_a_run_replayed_right_after_it_gives_each_step_and_feeds_the_floors(llama_engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=4, temperature=0)
    first = await final(llama_engine, [5, 6, 7], params)
    with StepRecorder(llama_engine.executor) as recorder:
        again = await final(llama_engine, [5, 6, 7], params)
    assert recorder.steps and again.outputs[0].token_ids == first.outputs[0].token_ids
    replay = await replay_run(llama_engine, recorder.steps)
    assert len(replay) == len(recorder.steps) and all(s > 0 for s in replay)
    assert await replay_run(llama_engine, []) == []
    floors = await measure_floors(llama_engine, recorder.steps, replay)
    assert floors is not None and floors.num_steps == len(replay) and floors.replay_seconds == sum(replay)
    # The replay rewrote only what those steps wrote: the engine serves the same tokens after it.
    assert (await final(llama_engine, [5, 6, 7], params)).outputs[0].token_ids == first.outputs[0].token_ids
