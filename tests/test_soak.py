"""Soak: 200 concurrent streams for 40 seconds while random control calls fire, some cancelled or timed out.

What must hold at the end: every request either finished (length, or abort with its reason) or was
cancelled by its own consumer, none hung; no KV block is held; every greedy output (the tokens of
aborted ones too) is a prefix of HF transformers' greedy continuation; the engine is alive.

The weight updates write checkpoint A's own weights again (from the files, staged or not, or as a
tensor dict through the weight-sync extension), so the reference stays valid while the update path
runs in every mode. ``AIOENGINE_SOAK_SECONDS`` sets the length (default 40, which keeps the whole suite
inside CI's 15 minutes; 60 or more for a longer soak).
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from aioengine import AsyncEngine, SamplingParams
from tests.conftest import engine_config
from tests.helpers import hf_generate

SECONDS = float(os.environ.get("AIOENGINE_SOAK_SECONDS", "40"))
STREAMS = 200
MAX_TOKENS = 48
NUM_PROMPTS = 24


@dataclass
class Tally:
    finished: collections.Counter[str] = field(default_factory=collections.Counter)
    cancelled_by_client: int = 0
    wrong: list[str] = field(default_factory=list)
    controls: collections.Counter[str] = field(default_factory=collections.Counter)


def hold_worker(worker: Any, seconds: float) -> None:
    """Runs on the worker thread: keeps it busy (an RPC slower than its timeout)."""
    time.sleep(seconds)


def prompts() -> list[list[int]]:
    gen = random.Random(7)
    return [[gen.randrange(3, 1000) for _ in range(gen.randrange(2, 40))] for _ in range(NUM_PROMPTS)]


async def consumer(engine: AsyncEngine, refs: list[list[int]], ps: list[list[int]], seed: int, deadline: float,
                   tally: Tally) -> None:  # fmt: skip
    gen = random.Random(seed)
    while time.monotonic() < deadline:
        i = gen.randrange(len(ps))
        params = SamplingParams(max_tokens=gen.randrange(4, MAX_TOKENS + 1), temperature=0, ignore_eos=True)
        give_up_after = gen.randrange(1, 12) if gen.random() < 0.15 else None  # a client that disconnects
        seen = 0
        out = None
        stream = engine.generate(ps[i], params)
        try:
            async for update in stream:
                out = update
                seen += 1
                if give_up_after is not None and seen >= give_up_after:
                    break
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        assert out is not None
        if list(out.token_ids) != refs[i][: len(out.token_ids)]:
            tally.wrong.append(f"prompt {i}: {list(out.token_ids)} is not a prefix of {refs[i]}")
        if out.finished:
            tally.finished[out.finish_reason or "none"] += 1
            if out.finish_reason == "length" and len(out.token_ids) != params.max_tokens:
                tally.wrong.append(f"prompt {i}: finished by length with {len(out.token_ids)} tokens")
        else:
            tally.cancelled_by_client += 1


async def control_storm(engine: AsyncEngine, ckpt: Path, deadline: float, tally: Tally) -> None:
    gen = random.Random(11)
    tensors = load_file(ckpt / "model.safetensors")

    async def one() -> None:
        op = gen.choice(["sleep", "update", "update_staged", "push", "rpc", "rpc_timeout"])
        if op == "sleep":
            await engine.sleep(gen.choice([1, 2]), mode=gen.choice(["wait", "abort", "keep"]))
        elif op == "update":
            await engine.update_weights(ckpt, mode=gen.choice(["pause", "drain", "abort", "recompute"]))
        elif op == "update_staged":
            await engine.update_weights(ckpt, mode="pause", stage=True)
        elif op == "push":
            await engine.collective_rpc("load_weights_from_tensors", (tensors,), {"partial": False})
        elif op == "rpc":
            await engine.collective_rpc("check_health", timeout=5)
        else:
            await engine.collective_rpc(hold_worker, (0.2,), timeout=0.05)  # times out; the call still runs
        tally.controls[op] += 1

    while time.monotonic() < deadline:
        await asyncio.sleep(gen.uniform(0.05, 0.6))
        task = asyncio.ensure_future(one())
        fate = gen.random()
        try:
            if fate < 0.2:
                await asyncio.sleep(gen.uniform(0.0, 0.05))
                task.cancel()
                await task
            elif fate < 0.35:
                await asyncio.wait_for(task, gen.uniform(0.001, 0.05))
            else:
                await task
        except (asyncio.CancelledError, TimeoutError):
            tally.controls["cancelled or timed out"] += 1
        # Whatever happened, bring the engine back to serving (a wake waits for a shielded sleep to end).
        await engine.wake_up()
        if not engine.stats().weights_valid:
            await engine.reload_weights()


@pytest.mark.slow
async def test_soak_streams_and_random_control_calls_lose_nothing_and_leak_nothing(llama_ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    ps = prompts()
    model = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32).eval()
    refs = hf_generate(model, ps, MAX_TOKENS)
    config = engine_config(llama_ckpt, parallel={"worker_extension_cls": "plugins.weight_sync.WeightSyncExtension"})
    tally = Tally()
    async with AsyncEngine(config) as engine:
        deadline = time.monotonic() + SECONDS
        async with asyncio.timeout(SECONDS + 120):  # a hung stream or control call fails here
            await asyncio.gather(
                control_storm(engine, llama_ckpt, deadline, tally),
                *(consumer(engine, refs, ps, seed, deadline, tally) for seed in range(STREAMS)),
            )
            await engine.wake_up()
        stats = engine.stats()
        summary: dict[str, Any] = {
            "finished": dict(tally.finished),
            "cancelled_by_client": tally.cancelled_by_client,
            "controls": dict(tally.controls),
            "steps": stats.num_steps,
            "tokens": stats.num_generated_tokens,
            "preemptions": stats.num_preemptions,
            "weights_version": stats.weights_version,
        }
        print(f"\nsoak {SECONDS:.0f}s, {STREAMS} streams: {summary}")
        assert not stats.dead
        assert tally.wrong == []
        assert (stats.requests_running, stats.requests_waiting, stats.requests_held) == (0, 0, 0)
        assert stats.kv_blocks_free == stats.kv_blocks_total, "a block leaked"
        assert tally.finished["length"] > STREAMS, "the streams made progress"
        assert sum(tally.controls.values()) > 10, "control calls fired"
