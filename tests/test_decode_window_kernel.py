"""A decode window in one call of the CPU kernels (``greedy_decode_window``, ``Worker.execute_window``): the tokens
of its steps run one at a time, with and without the greedy screen; the steps one at a time wherever a worker class
overrides ``execute_model`` or ``sample_tokens``; clear errors for inputs the kernel cannot run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from aioengine.messages import ModelRunnerOutput, SchedulerOutput
from aioengine.sampling.params import SamplingParams
from aioengine.worker.cpu_worker import CPUWorker
from tests.conftest import engine_config

pytestmark = pytest.mark.usefixtures("kernel")  # the kernels build here, or these skip


class CountingWorker(CPUWorker):
    """Counts the windows the kernels ran in one call."""

    fused = 0

    def execute_window(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = super().execute_window(scheduler_output)
        CountingWorker.fused += output is not None
        return output


class SteppingWorker(CPUWorker):
    """Overrides ``execute_model`` (and counts its calls): it must see every step of a window."""

    steps = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        SteppingWorker.steps += 1
        return super().execute_model(scheduler_output)


REQUESTS = [
    ([(7 * i + 3 * j) % 200 + 3 for j in range(5 + 9 * i % 40)], SamplingParams(temperature=0.0, max_tokens=5 + 7 * i))
    for i in range(10)
]
"""Greedy requests of many lengths (rows leave windows part-way, some end on EOS)."""


async def _generate(path: Path, decode_steps: int, worker: str = "auto", **device: Any) -> list[list[int]]:
    from aioengine import AsyncEngine

    config = engine_config(
        path,
        scheduler={"decode_steps": decode_steps, "decode_window_s": 10.0},
        parallel={"worker_cls": worker},
        device=device,
    )
    async with AsyncEngine(config) as engine:

        async def one(prompt: list[int], params: SamplingParams) -> list[int]:
            last = None
            async for out in engine.generate(prompt, params):
                last = out
            assert last is not None
            return list(last.token_ids)

        return list(await asyncio.gather(*(one(p, params) for p, params in REQUESTS)))


@pytest.mark.parametrize("screen", [True, False], ids=["greedy screen", "float32 head"])
async def test_windows_in_one_call_give_the_tokens_of_single_steps(llama_ckpt: Path, screen: bool) -> None:
    single = await _generate(llama_ckpt, 1, cpu_greedy_screen=screen)
    CountingWorker.fused = 0
    windowed = await _generate(llama_ckpt, 4, f"{__name__}.CountingWorker", cpu_greedy_screen=screen)
    assert windowed == single
    assert CountingWorker.fused > 0


async def test_a_worker_class_that_overrides_execute_model_runs_every_step_of_a_window(llama_ckpt: Path) -> None:
    single = await _generate(llama_ckpt, 1)
    SteppingWorker.steps = 0
    stepped = await _generate(llama_ckpt, 4, f"{__name__}.SteppingWorker")
    assert stepped == single
    # Every token after each request's first came from a forward of its own.
    assert SteppingWorker.steps >= max(len(tokens) for tokens in single)


def _window_errors(worker: Any) -> list[str]:
    """Runs the model's window on inputs it cannot run; the kernel's messages."""
    runner = worker.model_runner
    model, cache, bs = runner.model, runner.cache_engine.device_cache, runner.block_size
    one = torch.ones(1, dtype=torch.long)
    table = torch.tensor([[1]], dtype=torch.long)
    cases = [
        (one, one, table, torch.zeros(1, dtype=torch.long)),  # no steps
        (one * 10**6, one, table, one),  # a token outside the vocabulary
        (one, one * bs, table, one),  # a position past its block table
    ]
    messages = []
    with torch.inference_mode():
        for tokens, positions, tables, steps in cases:
            try:
                model.greedy_window(tokens, positions, tables, steps, cache, bs)
            except RuntimeError as exc:
                messages.append(str(exc).splitlines()[0])
            else:
                messages.append("ran")
    return messages


async def test_inputs_the_window_kernel_cannot_run_are_refused_by_name(llama_ckpt: Path) -> None:
    from aioengine import AsyncEngine
    from tests.helpers import final

    # Without the screen (which looks at rows before it is read) the head is the kernel's from the first step.
    async with AsyncEngine(engine_config(llama_ckpt, device={"cpu_greedy_screen": False})) as engine:
        messages = await engine.collective_rpc(_window_errors, unique_reply_rank=0)
        assert "runs 0 steps" in messages[0]
        assert "outside the vocabulary" in messages[1]
        assert "outside its block table" in messages[2]
        # and the engine serves on
        assert len((await final(engine, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))).token_ids) == 4
