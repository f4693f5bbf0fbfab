"""EnginePool: several models on one device under a memory budget."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aioengine import AsyncEngine, EnginePool, RequestOutput, SamplingParams
from aioengine.errors import ConfigurationError, InvalidRequestError
from tests.conftest import engine_config
from tests.helpers import last_output, wait_until

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [100, 200, 300, 400], [42, 43], [9] * 30, [11, 12, 13, 14, 15]]


async def _final(stream: AsyncIterator[RequestOutput]) -> list[int]:
    return (await last_output(stream)).token_ids


async def _reference(path: Path) -> list[list[int]]:
    async with AsyncEngine(engine_config(path, cache={"num_blocks": 256})) as engine:
        return [await _final(engine.generate(p, GREEDY)) for p in PROMPTS]


def _engines(llama: Path, qwen2: Path) -> dict[str, AsyncEngine]:
    """The pool's engines, built here so that the tests can ask them (not the pool) what they are doing."""
    return {"llama": AsyncEngine(engine_config(llama, cache={"num_blocks": 256})),
            "qwen2": AsyncEngine(engine_config(qwen2, cache={"num_blocks": 256}))}  # fmt: skip


def _awake(engines: dict[str, AsyncEngine]) -> tuple[str, ...]:
    """The engines awake by their own account."""
    return tuple(name for name, engine in engines.items() if not engine.stats().sleeping)


def record_transitions(engines: dict[str, AsyncEngine]) -> list[tuple[str, str, tuple[str, ...]]]:
    """Wraps every engine's wake_up and sleep; the list gets (event, engine, engines awake) before each
    wake and after each wake and sleep. Only these calls change what is awake, and a wake is the only
    one that adds to it: the states recorded right after the wakes are every state the pool was in."""
    log: list[tuple[str, str, tuple[str, ...]]] = []
    for name, engine in engines.items():
        wake_up, sleep = engine.wake_up, engine.sleep

        async def recorded_wake_up(*args: Any, _name: str = name, _call: Any = wake_up, **kwargs: Any) -> Any:
            log.append(("waking", _name, _awake(engines)))
            report = await _call(*args, **kwargs)
            log.append(("woke", _name, _awake(engines)))
            return report

        async def recorded_sleep(*args: Any, _name: str = name, _call: Any = sleep, **kwargs: Any) -> Any:
            report = await _call(*args, **kwargs)
            log.append(("slept", _name, _awake(engines)))
            return report

        engine.wake_up = recorded_wake_up  # type: ignore[method-assign]
        engine.sleep = recorded_sleep  # type: ignore[method-assign]
    return log


async def test_interleaved_requests_to_two_models_all_finish_and_never_both_awake(
    llama_ckpt: Path, qwen2_ckpt: Path
) -> None:
    refs = {"llama": await _reference(llama_ckpt), "qwen2": await _reference(qwen2_ckpt)}
    engines = _engines(llama_ckpt, qwen2_ckpt)
    async with EnginePool(engines) as pool:
        footprint = max(pool.stats().footprints.values())
        assert footprint > 0
        pool.budget_bytes = int(footprint * 1.5)  # room for one model, not two
        log = record_transitions(engines)
        jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("llama", "qwen2")]
        results = await asyncio.gather(*(_final(pool.generate(name, PROMPTS[i], GREEDY)) for name, i in jobs))
        for (name, i), tokens in zip(jobs, results, strict=True):
            assert tokens == refs[name][i], (name, i)
        assert pool.stats().switches >= 2
    wakes = [(name, before) for event, name, before in log if event == "waking"]
    assert {name for name, _ in wakes} == {"llama", "qwen2"}
    assert all(before == () for _, before in wakes), log  # the other one was asleep before every wake
    assert all(awake == (name,) for event, name, awake in log if event == "woke"), log
    assert all(len(awake) <= 1 for _, _, awake in log), log


async def test_max_awake_limits_awake_engines_without_a_budget(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    engines = _engines(llama_ckpt, qwen2_ckpt)
    async with EnginePool(engines, max_awake=1) as pool:
        await _final(pool.generate("llama", [1, 2, 3], GREEDY))
        assert pool.awake_models() == ["llama"] and _awake(engines) == ("llama",)
        await _final(pool.generate("qwen2", [1, 2, 3], GREEDY))
        assert pool.awake_models() == ["qwen2"] and _awake(engines) == ("qwen2",)


async def test_unbounded_pool_keeps_both_awake(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    engines = _engines(llama_ckpt, qwen2_ckpt)
    async with EnginePool(engines) as pool:
        await _final(pool.generate("llama", [1, 2, 3], GREEDY))
        await _final(pool.generate("qwen2", [1, 2, 3], GREEDY))
        assert sorted(pool.awake_models()) == ["llama", "qwen2"] and _awake(engines) == ("llama", "qwen2")


async def test_idle_engine_goes_to_sleep_by_itself(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    engines = _engines(llama_ckpt, qwen2_ckpt)
    async with EnginePool(engines, idle_timeout=0.1) as pool:
        await _final(pool.generate("llama", [1, 2, 3], GREEDY))
        assert _awake(engines) == ("llama",)
        await wait_until(lambda: _awake(engines) == (), "asleep after idle_timeout", timeout=10)
        assert pool.awake_models() == []
        assert await engines["llama"].is_sleeping()


class FailingSleep:
    """Stands in for an engine's ``sleep``: raises every time, counting the calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise RuntimeError("injected sleep failure")


async def test_a_failed_idle_sleep_is_logged_naming_the_model_and_the_idle_watcher_goes_on(
    llama_ckpt: Path, qwen2_ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aioengine.engine.pool")
    engines = _engines(llama_ckpt, qwen2_ckpt)
    async with EnginePool(engines, idle_timeout=0.1) as pool:
        failing = FailingSleep()
        monkeypatch.setattr(engines["llama"], "sleep", failing)  # after start, which sleeps every engine
        await _final(pool.generate("llama", [1, 2, 3], GREEDY))
        await _final(pool.generate("qwen2", [1, 2, 3], GREEDY))
        # The watcher tries llama first (it fails), then puts qwen2 to sleep, and tries llama again later.
        await wait_until(
            lambda: failing.calls >= 2 and _awake(engines) == ("llama",),
            "qwen2 asleep and llama's sleep tried twice",
            timeout=10,
            state=lambda: (failing.calls, _awake(engines)),
        )

    def told(record: logging.LogRecord) -> str:
        return record.getMessage() + (repr(record.exc_info[1]) if record.exc_info else "")

    failures = [r for r in caplog.records if r.levelno >= logging.WARNING and "llama" in r.getMessage()]
    assert any("injected sleep failure" in told(r) for r in failures), [told(r) for r in caplog.records]


async def test_the_pool_serves_both_models_after_an_idle_sleep_failed_and_shuts_down_cleanly(
    llama_ckpt: Path, qwen2_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engines = _engines(llama_ckpt, qwen2_ckpt)
    async with EnginePool(engines, idle_timeout=0.1) as pool:
        failing = FailingSleep()
        monkeypatch.setattr(engines["llama"], "sleep", failing)
        before = {name: await _final(pool.generate(name, PROMPTS[0], GREEDY)) for name in ("llama", "qwen2")}
        await wait_until(lambda: failing.calls >= 1, "the idle sleep of llama tried")
        for name in ("llama", "qwen2"):
            assert await _final(pool.generate(name, PROMPTS[0], GREEDY)) == before[name], name
    assert all(engine.stats().dead for engine in engines.values())


async def test_unknown_model_name_is_refused_naming_the_known_ones(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    async with EnginePool(_engines(llama_ckpt, qwen2_ckpt)) as pool:
        with pytest.raises(InvalidRequestError, match="llama, qwen2"):
            await _final(pool.generate("gpt", [1, 2], GREEDY))


async def test_a_model_larger_than_the_budget_is_refused_at_start(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    pool = EnginePool(_engines(llama_ckpt, qwen2_ckpt), budget_bytes=1024)
    with pytest.raises(ConfigurationError, match="budget"):
        await pool.start()
    await pool.shutdown()


async def test_awake_at_start_wakes_the_named_engine_once_footprints_are_measured(
    llama_ckpt: Path, qwen2_ckpt: Path
) -> None:
    engines = _engines(llama_ckpt, qwen2_ckpt)
    async with EnginePool(engines, max_awake=1, awake_at_start=["qwen2"]) as pool:
        assert _awake(engines) == ("qwen2",)
        assert all(footprint > 0 for footprint in pool.stats().footprints.values())
    with pytest.raises(ValueError, match="gpt"):
        EnginePool(_engines(llama_ckpt, qwen2_ckpt), awake_at_start=["gpt"])


async def test_use_keeps_an_engine_awake_until_the_block_ends(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    engines = _engines(llama_ckpt, qwen2_ckpt)
    async with EnginePool(engines, max_awake=1) as pool:
        async with pool.use("llama") as engine:
            assert engine is engines["llama"] and _awake(engines) == ("llama",)
            # A request for the other model must wait: llama is in use, so it cannot be put to sleep yet.
            other = asyncio.ensure_future(_final(pool.generate("qwen2", PROMPTS[0], GREEDY)))
            await wait_until(lambda: "llama" in pool._leaving, "the switch to qwen2 waiting on llama")
            stream = await engine.submit(PROMPTS[1], GREEDY)
            assert len([out async for out in stream]) >= 1
            assert _awake(engines) == ("llama",) and not other.done()
        await asyncio.wait_for(other, 60)
        assert _awake(engines) == ("qwen2",)


async def test_sleep_and_wake_up_through_the_pool_respect_its_budget(llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    engines = _engines(llama_ckpt, qwen2_ckpt)
    async with EnginePool(engines, max_awake=1) as pool:
        assert await pool.wake_up("llama") is not None and _awake(engines) == ("llama",)
        assert await pool.wake_up("llama") is None  # awake already
        await pool.wake_up("qwen2")
        assert _awake(engines) == ("qwen2",)  # llama was put to sleep to make room
        report = await pool.sleep("qwen2", level=2)
        assert report.level == 2 and _awake(engines) == ()
        # Woken by a request, with the weights a level-2 sleep discarded reloaded.
        refs = await _reference(qwen2_ckpt)
        assert await _final(pool.generate("qwen2", PROMPTS[0], GREEDY)) == refs[0]
