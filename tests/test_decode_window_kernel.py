"""A decode window in one call of the CPU kernels (``greedy_decode_window``, ``Worker.execute_window``): the tokens
of its steps run one at a time, with and without the greedy screen; the steps one at a time wherever a worker class
overrides ``execute_model`` or ``sample_tokens``; clear errors for inputs the kernel cannot run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from aioengine.messages import ModelRunnerOutput, SchedulerOutput
from aioengine.sampling.params import SamplingParams
from aioengine.worker.cpu_worker import CPUWorker
from tests.conftest import engine_config
from tests.test_decode_window import generate_all

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


PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(5 + 9 * i % 40)] for i in range(10)]
PLAIN = [(p, SamplingParams(temperature=0.0, max_tokens=5 + 7 * i)) for i, p in enumerate(PROMPTS)]
"""Greedy requests of many lengths: rows leave windows part-way."""


async def _generate(
    path: Path, decode_steps: int, requests: list[tuple[list[int], SamplingParams]], worker: str = "auto", **device: Any
) -> list[tuple[list[int], str | None]]:
    results, _ = await generate_all(path, decode_steps, requests, parallel={"worker_cls": worker}, device=device)
    return list(results)


def _with_stops(single: list[tuple[list[int], str | None]]) -> list[tuple[list[int], SamplingParams]]:
    """PLAIN with two requests ending inside a window on a stop id (the kernel ends a row on its stop ids and EOS
    alike), each taken from the request's own output one step at a time (its 7th and 10th token)."""
    requests = list(PLAIN)
    requests[3] = (PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[single[3][0][6]]))
    requests[5] = (PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[single[5][0][9]]))
    return requests


@pytest.mark.parametrize("screen", [True, False], ids=["greedy screen", "float32 head"])
async def test_windows_in_one_call_give_the_tokens_of_single_steps(llama_ckpt: Path, screen: bool) -> None:
    requests = _with_stops(await _generate(llama_ckpt, 1, PLAIN, cpu_greedy_screen=screen))
    single = await _generate(llama_ckpt, 1, requests, cpu_greedy_screen=screen)
    CountingWorker.fused = 0
    windowed = await _generate(llama_ckpt, 4, requests, f"{__name__}.CountingWorker", cpu_greedy_screen=screen)
    assert windowed == single
    assert single[3][1] == single[5][1] == "stop" and len(single[3][0]) <= 7 and len(single[5][0]) <= 10
    assert CountingWorker.fused > 0


async def test_a_worker_class_that_overrides_execute_model_runs_every_step_of_a_window(llama_ckpt: Path) -> None:
    single = await _generate(llama_ckpt, 1, PLAIN)
    SteppingWorker.steps = 0
    stepped = await _generate(llama_ckpt, 4, PLAIN, f"{__name__}.SteppingWorker")
    assert stepped == single
    # Every token after each request's first came from a forward of its own.
    assert SteppingWorker.steps >= max(len(tokens) for tokens, _ in single)


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


def _window_stopping(worker: Any) -> tuple[list[int], list[int], list[int]]:
    """One row's window of 4 steps into the free block 1 of an idle engine, run three times: alone, from strided
    views of the same inputs, then ending on the token its second step picks."""
    runner = worker.model_runner
    model, cache, bs = runner.model, runner.cache_engine.device_cache, runner.block_size
    one = torch.ones(1, dtype=torch.long)
    every_other = torch.tensor([5, 9, 0, 9, 4, 9])  # token, position and steps at stride 2
    with torch.inference_mode():
        run = model.greedy_window(one * 5, one * 0, torch.tensor([[1]]), one * 4, cache, bs)
        token, position, steps = every_other[0:2:2], every_other[2:4:2], every_other[4:6:2]
        strided = model.greedy_window(token, position, torch.tensor([[1, 7]])[:, ::2], steps, cache, bs)
        stop = torch.tensor([[-1, int(run[0, 1])]])
        stopped = model.greedy_window(one * 5, one * 0, torch.tensor([[1]]), one * 4, cache, bs, stop)
    return run[0].tolist(), strided[0].tolist(), stopped[0].tolist()


async def test_the_window_kernel_refuses_what_it_cannot_run_and_ends_a_row_on_its_stop_id(llama_ckpt: Path) -> None:
    from aioengine import AsyncEngine
    from tests.helpers import final

    # Without the screen (which looks at rows before it is read) the head is the kernel's from the first step.
    async with AsyncEngine(engine_config(llama_ckpt, device={"cpu_greedy_screen": False})) as engine:
        run, strided, stopped = await engine.collective_rpc(_window_stopping, unique_reply_rank=0)
        assert min(run) >= 0 and strided == run
        end = run.index(run[1])  # the row ends where it first picks that token
        assert stopped == [*run[: end + 1], *[-1] * (3 - end)]
        messages = await engine.collective_rpc(_window_errors, unique_reply_rank=0)
        assert "runs 0 steps" in messages[0]
        assert "outside the vocabulary" in messages[1]
        assert "outside its block table" in messages[2]
        # and the engine serves on
        assert len((await final(engine, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))).token_ids) == 4
