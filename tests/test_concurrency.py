"""Specification of many concurrent requests on one event loop: cancellations, leaks, a loop that runs
while the model computes, and continuous batching (requests join and leave between any two steps)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from tests.conftest import engine_config
from tests.helpers import final, wait_until_idle

NUM_REQUESTS = 200
TICK = 0.005
SLOW_FORWARD = 20 * TICK
TIMEOUT = 120.0
"""Seconds the whole storm may take before the test fails instead of hanging."""


@dataclass
class Spec:
    prompt: list[int]
    params: SamplingParams
    cancel_after_outputs: int | None = None
    """The consumer cancels its own task after this many outputs."""
    cancel_after_seconds: float | None = None
    """Another task cancels the consumer after this long (it may have finished by then)."""
    outputs: list[RequestOutput] = field(default_factory=list)


def make_specs(rng: random.Random) -> list[Spec]:
    specs = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.choice([1, 3, 8, 20, 45, 90]))]
        max_tokens = rng.randint(4, 16)
        kind = i % 3
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        specs.append(Spec(prompt, params))
    for i in rng.sample(range(NUM_REQUESTS), NUM_REQUESTS // 3):
        if rng.random() < 0.5:
            specs[i].cancel_after_outputs = rng.randint(1, specs[i].params.max_tokens - 1)
        else:
            specs[i].cancel_after_seconds = rng.uniform(0.0, 3.0)
    return specs


@dataclass
class Storm:
    engine: AsyncEngine
    specs: list[Spec]
    survivors: list[Spec]
    cancelled: list[Spec]
    errors: list[BaseException]
    steps: int
    generated_tokens: int


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def storm(llama_ckpt) -> AsyncIterator[Storm]:
    """NUM_REQUESTS concurrent generate() tasks, a third of them cancelled at random moments."""
    async with AsyncEngine(engine_config(llama_ckpt)) as engine:
        specs = make_specs(random.Random(20240517))

        async def consume(spec: Spec) -> None:
            async for out in engine.generate(spec.prompt, spec.params):
                spec.outputs.append(out)
                if len(spec.outputs) == spec.cancel_after_outputs:
                    asyncio.current_task().cancel()  # type: ignore[union-attr]
                    await asyncio.sleep(0)  # the cancellation lands here, in the consumer's own code

        async def cancel_later(task: asyncio.Task[None], delay: float) -> None:
            await asyncio.sleep(delay)
            task.cancel()

        before = engine.stats()
        tasks = [asyncio.create_task(consume(spec)) for spec in specs]
        cancellers = [
            asyncio.create_task(cancel_later(task, spec.cancel_after_seconds))
            for task, spec in zip(tasks, specs, strict=True)
            if spec.cancel_after_seconds is not None
        ]
        async with asyncio.timeout(TIMEOUT):
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*cancellers)
        after = engine.stats()
        yield Storm(
            engine=engine,
            specs=specs,
            survivors=[s for s, r in zip(specs, results, strict=True) if r is None],
            cancelled=[s for s, r in zip(specs, results, strict=True) if isinstance(r, asyncio.CancelledError)],
            errors=[r for r in results if r is not None and not isinstance(r, asyncio.CancelledError)],
            steps=after.num_steps - before.num_steps,
            generated_tokens=after.num_generated_tokens - before.num_generated_tokens,
        )


in_storm_loop = pytest.mark.asyncio(loop_scope="module")


@in_storm_loop
async def test_storm_raises_nothing_but_the_cancellations(storm):
    assert storm.errors == []
    assert len(storm.cancelled) >= NUM_REQUESTS // 6, "the storm should really cancel a good share"
    assert len(storm.survivors) + len(storm.cancelled) == NUM_REQUESTS


@in_storm_loop
async def test_storm_survivors_finish_with_all_their_tokens(storm):
    assert len(storm.survivors) >= NUM_REQUESTS // 2
    for spec in storm.survivors:
        last = spec.outputs[-1]
        assert last.finished and last.finish_reason == "length"
        assert len(last.token_ids) == spec.params.max_tokens


@in_storm_loop
async def test_storm_cancelled_requests_stop_generating(storm):
    # A cancelled request may still get the token of the step in flight (and its consumer may not
    # have read the last one published): allow 2 tokens beyond what its consumer saw.
    seen = sum(len(s.outputs[-1].token_ids) if s.outputs else 0 for s in storm.cancelled)
    budget = sum(s.params.max_tokens for s in storm.survivors) + seen + 2 * len(storm.cancelled)
    assert storm.generated_tokens <= budget
    assert storm.generated_tokens < sum(s.params.max_tokens for s in storm.specs)


@in_storm_loop
async def test_storm_leaves_no_request_and_no_block_behind(storm):
    await wait_until_idle(storm.engine)


@in_storm_loop
async def test_storm_greedy_survivors_match_the_same_prompt_alone(storm):
    greedy = [s for s in storm.survivors if s.params.temperature == 0.0]
    for spec in random.Random(3).sample(greedy, 5):
        alone = await final(storm.engine, spec.prompt, spec.params)
        assert spec.outputs[-1].token_ids == alone.token_ids


def slow_forward(worker: Any, seconds: float) -> None:
    """Every forward of ``worker``'s model first sleeps ``seconds`` on the thread it runs on, as a long
    compute would (time.sleep releases the GIL, as torch's kernels do). A step's forward runs the layers in
    ``final_hidden`` (``forward`` too goes through it)."""
    model = worker.model_runner.model
    final_hidden = model.final_hidden

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return final_hidden(*args, **kwargs)

    model.final_hidden = slow


async def test_event_loop_keeps_running_while_the_model_computes(llama_ckpt):
    # Each forward takes SLOW_FORWARD = 20 ticks. Computed on the worker thread, the loop ticks on
    # meanwhile; computed on the loop thread, a forward would let the ticker wake at most once.
    # One forward a step (no decode windows): the engine's steps count the forwards.
    scheduler = {"async_scheduling": False, "decode_steps": 1}
    async with AsyncEngine(engine_config(llama_ckpt, scheduler=scheduler)) as engine:
        await engine.collective_rpc(slow_forward, args=(SLOW_FORWARD,))
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(TICK)
                ticks += 1

        steps = engine.stats().num_steps
        ticking = asyncio.create_task(ticker())
        out = await final(engine, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        ticking.cancel()
        forwards = engine.stats().num_steps - steps
    assert len(out.token_ids) == 4 and forwards >= 4
    assert ticks >= 5 * forwards, f"the loop ticked {ticks} times during {forwards} forwards of {SLOW_FORWARD}s"


async def test_a_short_request_joining_later_finishes_before_the_long_one(llama_engine):
    engine = llama_engine
    long_params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    short_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    long_outputs: list[RequestOutput] = []
    three = asyncio.Event()

    async def long_request() -> None:
        async for out in engine.generate(list(range(10, 30)), long_params):
            long_outputs.append(out)
            if len(long_outputs[-1].token_ids) >= 3:
                three.set()

    async with asyncio.timeout(TIMEOUT):
        long_task = asyncio.create_task(long_request())
        await three.wait()
        long_tokens_at_join = len(long_outputs[-1].token_ids)
        short = await final(engine, list(range(40, 52)), short_params)
        long_tokens_at_leave = len(long_outputs[-1].token_ids)
        assert not long_task.done(), "the long request is still running when the short one is done"
        await long_task

    assert len(short.token_ids) == 4 and short.finish_reason == "length"
    assert long_tokens_at_join < long_tokens_at_leave < 48, "the long request kept decoding alongside"
    assert len(long_outputs[-1].token_ids) == 48
    await wait_until_idle(engine)
