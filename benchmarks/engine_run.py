"""aioengine offline: every request submitted at once, with a copy of each step the engine executed
kept aside so ``floors.py`` can replay exactly those batch shapes on the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aioengine import AsyncEngine, EngineConfig, SamplingParams
from aioengine.messages import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from benchmarks.cpu_load import CpuLoad
from benchmarks.loop_lag import LoopLag
from benchmarks.results import SystemResult
from benchmarks.workload import BenchRequest, output_tokens


@dataclass(frozen=True, slots=True)
class EngineRun:
    """The offline run: throughput, where its time went, and the steps it executed."""

    result: SystemResult
    wall: float
    worker_seconds: float
    num_steps: int
    loop_lag_p99: float | None
    idle_loop_lag_p99: float | None
    """The same ticker with the engine started but idle: the machine's own timer noise."""
    steps: list[SchedulerOutput]
    replay: tuple[float, ...] = ()
    """Each step's seconds replayed on the worker right after the run (``floors.replay_run``); empty if not."""


def engine_config(
    path: Path, reqs: list[BenchRequest], max_num_seqs: int, max_batched_tokens: int, *, prefix_caching: bool = False
) -> EngineConfig:
    """float32 on CPU with the issue's limits; a KV cache that holds every request at once (no preemption).
    Prefix caching is off unless asked for: repeats send the same prompts, which a cache would serve from the
    first repeat's KV (vLLM's runs turn it off too)."""
    sections: dict[str, Any] = dict(
        model={"path": str(path), "dtype": "float32"},
        device={"device": "cpu"},
        scheduler={"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_batched_tokens},
    )
    block = EngineConfig(**sections).cache.block_size
    blocks = sum(-(-(len(r.prompt) + r.max_tokens) // block) for r in reqs) + 64  # + null block and slack
    return EngineConfig(**sections, cache={"num_blocks": blocks, "enable_prefix_caching": prefix_caching})


OfflineOutputs = Literal["final_only", "stream"]
"""How the offline run reads its requests: "final_only", one output at the end and token ids only, as vLLM's
offline ``LLM.generate`` runs here (FINAL_ONLY outputs, ``detokenize=False``); "stream", an output at every step,
detokenized, as an application that streams text to its users."""


def params(req: BenchRequest, outputs: OfflineOutputs = "stream") -> SamplingParams:
    """Greedy, EOS ignored: exactly ``max_tokens`` tokens, read as ``outputs`` says."""
    final_only = outputs == "final_only"
    return SamplingParams(
        max_tokens=req.max_tokens,
        temperature=0,
        ignore_eos=True,
        detokenize=not final_only,
        output_kind="final_only" if final_only else "stream",
    )


async def stream_tokens(
    engine: AsyncEngine,
    req: BenchRequest,
    on_output: Callable[[int], None] | None = None,
    outputs: OfflineOutputs = "stream",
) -> int:
    """Consumes one request's stream; returns how many tokens it produced."""
    count = 0
    async for out in engine.generate(req.prompt, params(req, outputs)):
        count = len(out.token_ids)
        if on_output is not None:
            on_output(len(out.delta_token_ids))
    return count


def replayable(sched: SchedulerOutput) -> SchedulerOutput:
    """``sched`` with its placeholders (async scheduling) as token 0: a replay has no previous step to
    take them from, and which token a row computes does not change its cost."""
    reqs = [
        r.with_token_ids([0 if t == PLACEHOLDER_TOKEN_ID else t for t in r.token_ids])
        if PLACEHOLDER_TOKEN_ID in r.token_ids
        else r
        for r in sched.requests
    ]
    return dataclasses.replace(sched, requests=reqs)


class StepRecorder:
    """Keeps every SchedulerOutput passed to ``executor.submit_step`` inside the block.

    Wraps the bound method on the instance (restored on exit) and calls through unchanged, so the
    engine runs as it would. It keeps references only: the scheduler builds each step's requests
    and their lists anew and nothing changes them afterwards (tests/test_async_scheduling.py checks that).
    """

    def __init__(self, executor: Any) -> None:
        self.executor = executor
        self.steps: list[SchedulerOutput] = []

    def __enter__(self) -> StepRecorder:
        original = self.executor.submit_step

        def recording(sched: SchedulerOutput, *args: Any, **kwargs: Any) -> Any:
            self.steps.append(sched)
            return original(sched, *args, **kwargs)

        self.executor.submit_step = recording
        return self

    def __exit__(self, *exc: object) -> None:
        del self.executor.submit_step  # the instance attribute; the class's method shows again


LAG_TICK = 0.05
"""The timed run's loop-lag ticker, in seconds. Each tick wakes the event loop's thread, which on a 2-core
host preempts one of the two compute threads while the other waits for it: a 5 ms ticker (200 wakes a
second) made ~7,800 involuntary context switches in a 32 s run of the real model against ~1,600 without it,
and the worker's steps 10% slower than their replay. A lag probe the vLLM run does not carry is not the
engine's cost; 20 wakes a second sample the same oversleep."""


async def run_offline(engine: AsyncEngine, reqs: list[BenchRequest], outputs: OfflineOutputs) -> EngineRun:
    """All requests at once, read as ``outputs`` says; wall time from the first submission to the last token."""
    async with LoopLag() as idle:
        await asyncio.sleep(1.0)
    await stream_tokens(engine, BenchRequest(reqs[0].prompt[:16], 2))  # warm-up, untimed
    before = engine.stats()
    with StepRecorder(engine.executor) as recorder, CpuLoad() as load:
        async with LoopLag(LAG_TICK) as lag:
            start = time.perf_counter()
            counts = await asyncio.gather(*(stream_tokens(engine, r, outputs=outputs) for r in reqs))
            wall = time.perf_counter() - start
    after = engine.stats()
    short = sum(1 for c, r in zip(counts, reqs, strict=True) if c != r.max_tokens)
    read = "one output each, token ids" if outputs == "final_only" else "streamed, detokenized"
    note = f"{short} requests got a different token count" if short else f"all requests submitted at once; {read}"
    steps = after.num_steps - before.num_steps
    if len(recorder.steps) != steps:  # the engine no longer steps through executor.submit_step
        recorder.steps.clear()
    return EngineRun(
        result=SystemResult("aioengine", output_tokens(reqs) / wall, wall, note, load.others),
        wall=wall,
        worker_seconds=after.worker_seconds - before.worker_seconds,
        num_steps=steps,
        loop_lag_p99=lag.p99(),
        idle_loop_lag_p99=idle.p99(),
        steps=recorder.steps,
    )
