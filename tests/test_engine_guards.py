"""What an engine refuses outright instead of hanging: a stale stream touching a reused id, use from
another event loop, a start after shutdown, a prompt that can never be scheduled."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

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


async def test_a_huge_text_prompt_is_refused_before_it_is_tokenized(llama_engine: AsyncEngine) -> None:
    huge = "hello world " * 200_000  # 2.4 MB: far more tokens than max_model_len, whatever the tokenizer does
    with pytest.raises(RequestTooLargeError, match="at least"):  # the bound, not the tokenized count
        await final(llama_engine, huge, GREEDY)
    assert len((await final(llama_engine, "hello world", GREEDY)).token_ids) == 8


async def test_a_long_text_prompt_is_tokenized_off_the_event_loop(
    llama_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aioengine.engine import intake

    monkeypatch.setattr(intake, "LONG_PROMPT_CHARS", 100)
    real = llama_engine.tokenizer
    threads: list[str] = []

    def recording(text: str) -> Any:
        threads.append(threading.current_thread().name)
        return real(text)

    monkeypatch.setattr(llama_engine, "tokenizer", recording)
    short, long = "hello", "the engine reads a prompt " * 20
    await final(llama_engine, short, GREEDY)
    out = await final(llama_engine, long, GREEDY)
    assert threads[0] == threading.current_thread().name  # a short prompt: on the loop, no hand-off
    assert threads[1] != threading.current_thread().name
    assert out.prompt_token_ids == real(long).input_ids and len(out.token_ids) == 8


def test_the_sync_engine_refuses_a_batch_with_one_bad_prompt_and_leaves_nothing_running(llama_ckpt: Path) -> None:
    from aioengine import Engine
    from aioengine.errors import InvalidRequestError

    with Engine(engine_config(llama_ckpt)) as engine:
        prompts: list[Any] = [[5, 6, 7 + i] for i in range(8)] + [[]]
        with pytest.raises(InvalidRequestError, match="empty"):
            engine.generate(prompts, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), use_tqdm=False)
        stats = engine.stats()
        assert (stats.requests_running, stats.requests_waiting) == (0, 0)
        assert stats.kv_blocks_free == stats.kv_blocks_total
        assert stats.num_generated_tokens < 8 * 200


async def test_shutdown_while_start_runs_ends_both_cleanly(llama_ckpt: Path) -> None:
    engine = AsyncEngine(engine_config(llama_ckpt))
    starting = asyncio.ensure_future(engine.start())
    await asyncio.sleep(0)  # the start has begun
    await engine.shutdown()
    await starting  # no CancelledError, no AssertionError
    with pytest.raises(EngineDeadError):
        await final(engine, [5, 6, 7], GREEDY)
    assert not [t for t in threading.enumerate() if t.name.startswith("aioengine-worker")], "shutdown reaps the thread"


def hold_worker(worker: Any, seconds: float) -> None:
    """Runs on the worker thread: keeps it busy."""
    time.sleep(seconds)


async def test_an_rpc_past_its_timeout_makes_the_engine_say_it_is_held_until_the_call_returns(
    llama_engine: AsyncEngine,
) -> None:
    with pytest.raises(TimeoutError, match="still runs on the worker thread"):
        await llama_engine.collective_rpc(hold_worker, (1.0,), timeout=0.05)
    for _ in range(3):  # the loop goes on meanwhile; the call still runs, and is still said to
        await asyncio.sleep(0)
    with pytest.raises(EngineStateError, match="hold_worker"):
        await llama_engine.check_health()
    out = await final(llama_engine, [5, 6, 7], GREEDY)  # waits behind the call, then runs
    assert len(out.token_ids) == 8
    await llama_engine.check_health()  # the call returned: healthy again


class StatefulExtension:
    """A mixin with its own state, set up in its own ``__init__`` (cooperative, no arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls_seen = 0
        self.rank_at_init = self.rank  # type: ignore[attr-defined]

    def count_call(self) -> tuple[int, int]:
        self.calls_seen += 1
        return self.calls_seen, self.rank_at_init


class DeviceClashExtension:
    def device(self) -> str:  # the worker sets self.device on its instance
        return "mine"


async def test_a_worker_extension_init_runs_once_with_the_worker_set_up(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt, parallel={"worker_extension_cls": StatefulExtension}) as engine:
        assert await engine.collective_rpc("count_call") == [(1, 0)]
        assert await engine.collective_rpc("count_call") == [(2, 0)]


async def test_an_extension_name_the_worker_sets_on_its_instance_is_refused_at_start(
    make_engine, llama_ckpt: Path
) -> None:
    from aioengine.errors import ConfigurationError

    engine = make_engine(llama_ckpt, parallel={"worker_extension_cls": DeviceClashExtension})
    with pytest.raises(ConfigurationError, match=r"\['device'\].*sets on its instance"):
        await engine.start()


async def test_requests_in_flight_at_shutdown_end_with_request_aborted_error_naming_them(llama_ckpt: Path) -> None:
    from aioengine.errors import RequestAbortedError

    engine = AsyncEngine(engine_config(llama_ckpt))
    await engine.start()
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    streams = [asyncio.ensure_future(final(engine, [5, 6, 7 + i], params, request_id=f"r{i}")) for i in range(3)]
    async with asyncio.timeout(TIMEOUT):
        while engine.stats().requests_running < 3:
            await asyncio.sleep(0.001)
    await engine.shutdown()
    for i, stream in enumerate(streams):
        with pytest.raises(RequestAbortedError, match=f"'r{i}' did not finish: engine was shut down") as err:
            await stream
        assert isinstance(err.value, EngineDeadError)
