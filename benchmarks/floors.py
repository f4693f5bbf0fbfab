"""Floors for the offline run: what the engine's steps cost with nothing around them.

1. Replay: every SchedulerOutput the engine executed, run again on the worker thread in one
   ``collective_rpc`` call (``execute_and_sample`` back to back, timed inside the worker). Engine
   efficiency = replay / wall; the rest of the wall time is scheduling, the executor bridge, output
   processing and any idle worker time. Each run is replayed right after it (``replay_run``): the host's
   speed comes in spells, and a replay taken later, in another spell, tells the spells apart, not the engine's
   share (one replay after five runs of the tiny model put its efficiency at 0.78; each run's own, at 0.88-0.95).
2. GEMMs only: every Linear of the engine's model run alone, as the engine runs it (lm_head at the
   step's sample count, the others at its token count), for the same steps (each step of a decode window), on the
   same thread.

The replay rewrites KV blocks the finished requests no longer own, with the same values.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from aioengine.engine.async_engine import AsyncEngine
from aioengine.executor.base import execute_and_sample
from aioengine.messages import SchedulerOutput
from benchmarks.cpu_load import CpuLoad
from benchmarks.engine_run import replayable
from benchmarks.results import Floors


def _is_prefill(step: SchedulerOutput) -> bool:
    return any(len(r.token_ids) > 1 or not r.sample for r in step.requests)


def _forwards(step: SchedulerOutput) -> list[tuple[int, int]]:
    """(tokens, samples) of each forward ``step`` runs: one, or one per step of a decode window (each row of a
    window one token and one sample a step, for its own ``num_steps``)."""
    if step.num_steps == 1:
        return [(step.num_tokens, sum(1 for r in step.requests if r.sample))]
    rows = [sum(1 for r in step.requests if r.num_steps > i) for i in range(step.num_steps)]
    return [(n, n) for n in rows]


def replay_steps(worker: Any, steps: list[SchedulerOutput]) -> list[float]:
    """Runs on the worker: seconds of ``execute_and_sample`` for each step, in order."""
    seconds = []
    for step in steps:
        start = time.perf_counter()
        execute_and_sample(worker, step)
        seconds.append(time.perf_counter() - start)
    return seconds


def _linears(model: nn.Module) -> tuple[list[nn.Linear], list[nn.Linear]]:
    """(layers applied to every token, layers applied only to sampled rows, i.e. the lm_head)."""
    body: list[nn.Linear] = []
    head: list[nn.Linear] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            (head if name.split(".")[-1] == "lm_head" else body).append(module)
    return body, head


@torch.inference_mode()
def gemm_steps(worker: Any, shapes: list[tuple[int, int]]) -> list[float]:
    """Runs on the worker: seconds of the model's GEMMs alone for each (tokens, samples) step.

    Each layer runs as the engine runs it (its own forward: oneDNN-packed weights where they are on).
    """
    runner = worker.model_runner
    body, head = _linears(runner.model)
    most = max((n for n, _ in shapes), default=1)
    # The runner's device and dtype: a weight whose packed copy is its one store is a meta placeholder.
    inputs = {
        m.in_features: torch.randn(most, m.in_features, dtype=runner.dtype, device=runner.device) for m in body + head
    }
    seconds = []
    for num_tokens, num_samples in shapes:
        start = time.perf_counter()
        for m in body:
            m(inputs[m.in_features][:num_tokens])
        if num_samples:
            for m in head:
                m(inputs[m.in_features][:num_samples])
        seconds.append(time.perf_counter() - start)
    return seconds


async def replay_run(engine: AsyncEngine, steps: list[SchedulerOutput]) -> list[float]:
    """Seconds of each of ``steps`` replayed on the worker now; the engine must be idle."""
    if not steps:
        return []
    seconds: list[float] = await engine.collective_rpc(
        replay_steps, ([replayable(s) for s in steps],), unique_reply_rank=0
    )
    return seconds


async def measure_floors(engine: AsyncEngine, steps: list[SchedulerOutput], replay: list[float]) -> Floors | None:
    """Both floors for ``steps`` (None when no steps were recorded), the replay's being ``replay``: the seconds
    ``replay_run`` took for them right after their run. The GEMM floor is measured here; the engine must be idle."""
    if not steps:
        return None
    shapes = [shape for s in steps for shape in _forwards(s)]
    with CpuLoad() as load:
        gemm = await engine.collective_rpc(gemm_steps, (shapes,), unique_reply_rank=0)
    prefill = [i for i, s in enumerate(steps) if _is_prefill(s)]
    return Floors(
        num_steps=len(steps),
        num_forwards=len(shapes),
        num_prefill_steps=len(prefill),
        replay_seconds=sum(replay),
        replay_prefill_seconds=sum(replay[i] for i in prefill),
        gemm_seconds=sum(gemm),
        others_load=load.others,
    )
