"""EnginePool switches: who is put to sleep, who waits, and what a switch never breaks."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from aioengine import AsyncEngine, EnginePool, SamplingParams
from aioengine.errors import ConfigurationError
from aioengine.testing import build_checkpoint
from tests.conftest import engine_config
from tests.helpers import last_output, wait_until

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
PROMPT = [5, 6, 7, 8]


def configs(path: Path, names: str) -> dict[str, object]:
    return {name: engine_config(path, cache={"num_blocks": 64}) for name in names}


async def reference(path: Path) -> list[int]:
    async with AsyncEngine(engine_config(path, cache={"num_blocks": 64})) as engine:
        return list((await last_output(engine.generate(PROMPT, GREEDY))).token_ids)


async def test_a_level_2_pool_reloads_the_weights_of_the_engine_it_wakes(llama_ckpt: Path) -> None:
    expected = await reference(llama_ckpt)
    async with EnginePool(configs(llama_ckpt, "ab"), max_awake=1, sleep_level=2) as pool:  # type: ignore[arg-type]
        for name in "abab":
            out = await last_output(pool.generate(name, PROMPT, GREEDY))
            assert list(out.token_ids) == expected, f"{name} after a level-2 switch"


async def test_an_idle_engine_is_put_to_sleep_before_a_busy_one(llama_ckpt: Path) -> None:
    async with EnginePool(configs(llama_ckpt, "abc"), max_awake=2) as pool:  # type: ignore[arg-type]
        await last_output(pool.generate("a", PROMPT, GREEDY))
        await last_output(pool.generate("b", PROMPT, GREEDY))  # b is now the most recently used
        busy = asyncio.ensure_future(last_output(pool.generate("a", PROMPT, LONG)))
        await wait_until(lambda: pool.stats().active["a"] == 1, "a is busy")
        await last_output(pool.generate("c", PROMPT, GREEDY))
        assert sorted(pool.awake_models()) == ["a", "c"], "the idle b went to sleep, not the busy a"
        assert len((await busy).token_ids) == LONG.max_tokens  # never interrupted


async def test_a_request_to_an_awake_model_does_not_wait_for_a_switch_draining_another(llama_ckpt: Path) -> None:
    expected = await reference(llama_ckpt)
    async with EnginePool(configs(llama_ckpt, "abc"), max_awake=2) as pool:  # type: ignore[arg-type]
        await last_output(pool.generate("a", PROMPT, GREEDY))
        await last_output(pool.generate("b", PROMPT, GREEDY))
        busy_a = asyncio.ensure_future(last_output(pool.generate("a", PROMPT, LONG)))
        busy_b = asyncio.ensure_future(last_output(pool.generate("b", PROMPT, LONG)))
        await wait_until(lambda: pool.stats().active == {"a": 1, "b": 1, "c": 0}, "a and b are busy")
        switch = asyncio.ensure_future(last_output(pool.generate("c", PROMPT, GREEDY)))
        await wait_until(lambda: pool.stats().leaving == ("a",), "the switch waits for a, the least recent")
        out = await last_output(pool.generate("b", PROMPT, GREEDY))  # b is awake and stays so
        assert list(out.token_ids) == expected
        assert not switch.done(), "b's request finished while the switch was still draining a"
        assert list((await switch).token_ids) == expected
        await asyncio.gather(busy_a, busy_b)


async def test_a_client_gone_during_a_switch_leaves_both_models_serving(llama_ckpt: Path) -> None:
    expected = await reference(llama_ckpt)
    async with EnginePool(configs(llama_ckpt, "ab"), max_awake=1) as pool:  # type: ignore[arg-type]
        await last_output(pool.generate("a", PROMPT, GREEDY))
        busy = asyncio.ensure_future(last_output(pool.generate("a", PROMPT, SamplingParams(max_tokens=60))))
        await wait_until(lambda: pool.stats().active["a"] == 1, "a is busy")
        switching = asyncio.ensure_future(last_output(pool.generate("b", PROMPT, GREEDY)))
        await wait_until(lambda: pool.stats().leaving == ("a",), "the switch waits for a")
        switching.cancel()  # the client disconnects while a is being put to sleep
        with pytest.raises(asyncio.CancelledError):
            await switching
        await busy
        for name in "bab":
            assert list((await last_output(pool.generate(name, PROMPT, GREEDY))).token_ids) == expected
        assert not any(t.engine.stats().dead for t in pool.tenants.values())


async def test_a_pool_refused_at_start_leaves_no_worker_thread(llama_ckpt: Path) -> None:
    before = {t.ident for t in threading.enumerate()}
    pool = EnginePool(configs(llama_ckpt, "ab"), budget_bytes=1024)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="budget"):
        await pool.start()
    left = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("aioengine")]
    assert left == [], "the first engine's worker thread outlived the refused start"


async def test_a_level_2_pool_keeps_weights_pushed_since_the_checkpoint(llama_ckpt: Path, tmp_path: Path) -> None:
    pushed = build_checkpoint(tmp_path / "pushed", "llama", seed=1)
    expected = await reference(pushed)
    assert expected != await reference(llama_ckpt), "the pushed weights must answer differently"
    async with EnginePool(configs(llama_ckpt, "ab"), max_awake=1, sleep_level=2) as pool:  # type: ignore[arg-type]
        async with pool.use("a") as engine:
            await engine.update_weights(pushed)
        await last_output(pool.generate("b", PROMPT, GREEDY))  # a goes to sleep: level 1, its weights are pushed
        assert pool.tenants["a"].engine.stats().sleeping
        out = await last_output(pool.generate("a", PROMPT, GREEDY))
        assert list(out.token_ids) == expected, "the switch lost the pushed weights"
        await last_output(pool.generate("b", PROMPT, GREEDY))  # b was never pushed: level 2, reloaded on wake
        assert list((await last_output(pool.generate("b", PROMPT, GREEDY))).token_ids) == await reference(llama_ckpt)
