"""What an engine refuses outright instead of hanging: a stale stream touching a reused id, use from
another event loop, a start after shutdown, a prompt that can never be scheduled."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from aioengine import AsyncEngine, SamplingParams
from aioengine.errors import EngineDeadError, EngineStateError, RequestTooLargeError
from tests.conftest import engine_config
from tests.helpers import TIMEOUT, final

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


async def test_closing_a_stale_stream_leaves_a_new_request_with_the_same_id_alone(llama_engine: AsyncEngine) -> None:
    old = llama_engine.generate([5, 6, 7], GREEDY, request_id="same")
    first = await anext(old)  # read one output, then let the request finish without reading on
    assert not first.finished
    async with asyncio.timeout(TIMEOUT):
        while llama_engine.stats().requests_running:
            await asyncio.sleep(0.001)
    stream = llama_engine.generate(
        [9, 10, 11], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), request_id="same"
    )
    out = await anext(stream)  # the new request runs
    await old.aclose()  # the old stream's clean-up must not abort the new request
    async with asyncio.timeout(TIMEOUT):
        outputs = [out] + [later async for later in stream]
    out = outputs[-1]
    assert out.finished and out.finish_reason == "length" and len(out.token_ids) == 40


async def test_an_engine_used_from_another_event_loop_refuses_at_once(llama_ckpt: Path) -> None:
    async with AsyncEngine(engine_config(llama_ckpt)) as engine:
        errors: list[BaseException] = []

        def other_loop() -> None:
            async def use() -> None:
                await final(engine, [5, 6, 7], GREEDY)

            try:
                asyncio.run(use())
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=other_loop)
        thread.start()
        await asyncio.to_thread(thread.join, TIMEOUT)
        assert not thread.is_alive(), "the other loop's consumer hung"
        assert len(errors) == 1 and isinstance(errors[0], EngineStateError)
        assert "another event loop" in str(errors[0])
        assert len((await final(engine, [5, 6, 7], GREEDY)).token_ids) == 8  # its own loop still works


async def test_start_after_shutdown_is_refused(llama_ckpt: Path) -> None:
    engine = AsyncEngine(engine_config(llama_ckpt))
    await engine.start()
    await engine.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        await engine.start()


async def test_a_prompt_longer_than_one_step_without_chunked_prefill_is_refused_and_others_run(
    make_engine, llama_ckpt: Path
) -> None:
    async with make_engine(
        llama_ckpt, scheduler={"enable_chunked_prefill": False, "max_num_batched_tokens": 64}
    ) as engine:
        with pytest.raises(RequestTooLargeError, match="max_num_batched_tokens=64"):
            await final(engine, list(range(3, 103)), GREEDY)
        assert len((await final(engine, list(range(3, 50)), GREEDY)).token_ids) == 8
