"""The throughput benchmark's floors on a served engine (untimed: only that they run and cover the steps), and the
per-repeat figures made of each repeat's replay."""

from __future__ import annotations

import pytest

from aioengine import AsyncEngine, SamplingParams
from benchmarks.ceiling import Ceiling, GemmPeak, WorkloadFlops
from benchmarks.engine_run import EngineRun, StepRecorder
from benchmarks.floors import gemm_steps, measure_floors, replay_run
from benchmarks.report import efficiencies, replay_lines, replay_shares
from benchmarks.results import SystemResult
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


def test_each_repeat_s_efficiency_and_replay_share_come_from_its_own_replay() -> None:
    def repeat(tokens_per_s: float, wall: float, replay: tuple[float, ...]) -> EngineRun:
        return EngineRun(SystemResult("aioengine", tokens_per_s, wall), wall, wall, 2, None, None, [], replay)

    # 1000 output tokens at a ceiling of 2000 tok/s: 0.5 s of ceiling time.
    ceiling = Ceiling(GemmPeak(2e11, (8, 8, 8), {}, 2), WorkloadFlops(1e11, 0.0, 0.0, 1000, 2000))
    repeats = [repeat(1000 / 0.8, 0.8, (0.3, 0.3)), repeat(1000 / 1.0, 1.0, ()), repeat(1000 / 0.5, 0.5, (0.5,))]
    assert efficiencies(repeats) == pytest.approx([0.75, 1.0])  # the unreplayed repeat is left out
    assert replay_shares(repeats, ceiling) == pytest.approx([0.5 / 0.6, 1.0])
    assert replay_shares(repeats, None) == []
    assert replay_lines(repeats, ceiling)[1].endswith("0.83, 1.00")
