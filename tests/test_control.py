"""Control calls (sleep, wake, weight updates) and the one session they share (EngineCore.control).

A worker call that has started runs to its end and its outcome is recorded, whatever happens to
its caller; a call that fails, or is cancelled before its worker call starts, leaves the engine as
it was; weight writes through an extension count like update_weights.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from aioengine import AsyncEngine, SamplingParams
from aioengine.testing import build_checkpoint
from tests.conftest import engine_config
from tests.helpers import TIMEOUT, final, hf_generate

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 99, 17, 23]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SYNC_EXTENSION = {"parallel": {"worker_extension_cls": "plugins.weight_sync.WeightSyncExtension"}}


def slow_down(worker: Any, method: str, seconds: float) -> None:
    """Runs on the worker thread: makes ``worker.<method>`` take ``seconds`` longer (it then runs as before)."""
    original = getattr(worker, method)

    def slowed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return original(*args, **kwargs)

    setattr(worker, method, slowed)


def calls_started(worker: Any, method: str, started: list[str]) -> None:
    """Runs on the worker thread: records in ``started`` when ``worker.<method>`` begins."""
    original = getattr(worker, method)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        started.append(method)
        return original(*args, **kwargs)

    setattr(worker, method, recorded)


async def until(condition: Any, what: str) -> None:
    """Waits (yielding to the loop) until ``condition()`` holds; fails after TIMEOUT."""
    async with asyncio.timeout(TIMEOUT):
        while not condition():
            await asyncio.sleep(0.001)
    assert condition(), what


async def tokens(engine: AsyncEngine) -> list[list[int]]:
    outs = await asyncio.gather(*(final(engine, p, GREEDY) for p in PROMPTS))
    return [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama-b", "llama", seed=1)


@pytest.fixture
async def engine(llama_ckpt: Path) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(engine_config(llama_ckpt, **SYNC_EXTENSION)) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(llama_ckpt: Path, ckpt_b: Path) -> dict[str, list[list[int]]]:
    """HF transformers' greedy tokens for PROMPTS on checkpoints A and B."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for name, path in (("A", llama_ckpt), ("B", ckpt_b)):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        refs[name] = hf_generate(model, PROMPTS, GREEDY.max_tokens)
    assert refs["A"] != refs["B"]
    return refs


# ---- a caller that goes away -----------------------------------------------------------------------------
async def test_a_sleep_whose_caller_times_out_completes_and_the_engine_stays_whole(
    engine: AsyncEngine, reference: dict[str, list[list[int]]]
) -> None:
    started: list[str] = []
    await engine.collective_rpc(slow_down, args=("sleep", 0.5))
    await engine.collective_rpc(calls_started, args=("sleep", started))
    sleeping = asyncio.ensure_future(engine.sleep(level=1))
    await until(lambda: started == ["sleep"], "the worker's sleep began")
    sleeping.cancel()  # as asyncio.wait_for does on timeout, with the worker mid-sleep
    with pytest.raises(asyncio.CancelledError):
        await sleeping
    late = asyncio.ensure_future(final(engine, PROMPTS[0], GREEDY))  # submitted meanwhile: waits for the wake
    report = await engine.wake_up()  # the next control call waits for the sleep to be over
    assert report.restored_bytes.kv_cache > 0, "the sleep ran to its end and was recorded, so the wake restores"
    assert not await engine.is_sleeping()
    assert list((await late).token_ids) == reference["A"][0]
    assert await tokens(engine) == reference["A"]


async def test_a_wait_for_around_sleep_times_out_without_killing_the_engine(
    engine: AsyncEngine, reference: dict[str, list[list[int]]]
) -> None:
    await engine.collective_rpc(slow_down, args=("sleep", 0.3))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(engine.sleep(level=2), 0.05)
    await engine.wake_up()
    assert engine.stats().weights_valid is False  # the level-2 sleep happened and is known
    await engine.reload_weights()
    assert not engine.stats().dead
    assert await tokens(engine) == reference["A"]


async def test_cancelling_an_update_in_its_worker_call_still_swaps_and_counts_the_version(
    engine: AsyncEngine, ckpt_b: Path, reference: dict[str, list[list[int]]]
) -> None:
    started: list[str] = []
    await engine.collective_rpc(slow_down, args=("update_weights", 0.3))
    await engine.collective_rpc(calls_started, args=("update_weights", started))
    update = asyncio.ensure_future(engine.update_weights(ckpt_b))
    await until(lambda: started == ["update_weights"], "the worker's update began")
    update.cancel()
    with pytest.raises(asyncio.CancelledError):
        await update
    out = await final(engine, PROMPTS[0], GREEDY)  # runs once the write is over, on the new weights
    assert out.weights_version == 1 == engine.weights_version
    assert list(out.token_ids) == reference["B"][0]


async def test_cancelling_a_sleep_while_it_drains_leaves_the_engine_awake_and_loses_nothing(
    engine: AsyncEngine, reference: dict[str, list[list[int]]]
) -> None:
    long = asyncio.ensure_future(final(engine, PROMPTS[1], SamplingParams(max_tokens=60, temperature=0)))
    await until(lambda: engine.stats().requests_running == 1, "the long request runs")
    sleeping = asyncio.ensure_future(engine.sleep(level=1, mode="wait"))
    await until(lambda: engine.stats().draining, "the sleep drains")
    held = asyncio.ensure_future(final(engine, PROMPTS[0], GREEDY))
    await until(lambda: engine.stats().requests_held == 1, "a request that arrives during the drain is held")
    sleeping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeping
    assert not await engine.is_sleeping()
    assert not engine.stats().draining
    assert list((await held).token_ids) == reference["A"][0]
    assert len((await long).token_ids) == 60


# ---- weight writes through an extension --------------------------------------------------------------
async def test_a_tensor_push_through_the_weight_sync_extension_bumps_the_version_outputs_carry(
    engine: AsyncEngine, ckpt_b: Path, reference: dict[str, list[list[int]]]
) -> None:
    before = await final(engine, PROMPTS[0], GREEDY)
    report = await engine.collective_rpc("load_weights_from_tensors", args=(load_file(ckpt_b / "model.safetensors"),),
                                         kwargs={"partial": False}, unique_reply_rank=0)  # fmt: skip
    assert report.weights_version == 1 == engine.weights_version
    after = await final(engine, PROMPTS[0], GREEDY)
    assert (before.weights_version, after.weights_version) == (0, 1)
    assert await tokens(engine) == reference["B"]


async def test_a_full_push_after_a_level_2_sleep_makes_the_engine_serve_again(
    engine: AsyncEngine, ckpt_b: Path, reference: dict[str, list[list[int]]]
) -> None:
    # The RL loop: sleep(2) while training, wake, push the trained weights, go on. No reload needed.
    await engine.sleep(level=2)
    await engine.wake_up()
    assert engine.stats().weights_valid is False
    await engine.collective_rpc("load_weights_from_tensors", args=(load_file(ckpt_b / "model.safetensors"),),
                                kwargs={"partial": False})  # fmt: skip
    assert engine.stats().weights_valid is True
    assert await tokens(engine) == reference["B"]


async def test_a_partial_push_after_a_level_2_sleep_does_not_make_the_weights_valid(
    engine: AsyncEngine, ckpt_b: Path
) -> None:
    await engine.sleep(level=2)
    await engine.wake_up()
    one = dict(list(load_file(ckpt_b / "model.safetensors").items())[:1])
    report = await engine.collective_rpc("load_weights_from_tensors", args=(one,), unique_reply_rank=0)
    assert report.weights_valid is False
    assert engine.stats().weights_valid is False  # the rest is still discarded: no step may run
    await engine.reload_weights()
    assert engine.stats().weights_valid is True
