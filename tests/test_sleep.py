"""Specification of sleep / wake through the public API: AsyncEngine.sleep, wake_up, is_sleeping,
reload_weights.

Expected outputs come from a run of the same engine before it slept (or from an uninterrupted run
of the same prompts); expected byte counts come from the checkpoint's own config and tensors, never
from the engine. Memory is read from the process (/proc/self/statm): the thread executor runs the
worker in its engine's process, so what the worker frees shows in that resident set. The memory tests
run their engine in a fresh interpreter, where no earlier test's heap or collected engine can move it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from aioengine.errors import EngineDeadError
from aioengine.messages import TagBytes
from aioengine.testing import build_checkpoint
from tests.helpers import TIMEOUT, wait_until
from tests.sleep_support import PROMPTS, assert_queued_without_a_step, final, greedy, token_ids

MEMORY_BLOCKS = 8192
"""KV blocks of the level 1 memory test: 256 MiB with the ``big_ckpt`` shape, so the drop dominates noise."""
LEVEL_2_BLOCKS = 2048
"""64 MiB: about the weights' size, so neither the KV cache nor the weights alone makes 80% of the sum."""


def rss_bytes() -> int:
    """Resident bytes of this process, after collecting garbage: an engine of an earlier test that
    is collected during a sleep would otherwise count as memory the sleep freed."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # heap pages freed earlier go back to the OS now
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def use_whole_kv_cache(engine: AsyncEngine) -> None:
    """Writes every block of the KV cache, as a cache in full use is: the host's cache takes memory only
    as its pages are first written (``cache_engine.host_zeros``)."""

    def write(worker: Any) -> None:
        for layer in worker.model_runner.cache_engine.device_cache:
            layer.zero_()

    await engine.collective_rpc(write)


def kv_cache_bytes(path: Path, num_blocks: int, block_size: int = 16) -> int:
    """num_layers * 2 (K, V) * block_size * kv_heads * head_dim * 4 (float32) * num_blocks, from config.json."""
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * block_size * cfg["num_key_value_heads"] * head_dim * 4 * num_blocks


def weight_bytes(path: Path) -> int:
    """Bytes of every tensor in the checkpoint as float32 (the engine's dtype in these tests)."""
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                numel = 1
                for dim in f.get_slice(name).get_shape():
                    numel *= dim
                total += numel * 4
    return total


MEMORY_SCRIPT = """
import asyncio, json, sys
from pathlib import Path
from aioengine import AsyncEngine
from tests.conftest import engine_config
from tests.test_sleep import rss_bytes, use_whole_kv_cache

async def main(path, blocks, level):
    rss = {}
    async with AsyncEngine(engine_config(Path(path), cache={"num_blocks": blocks})) as engine:
        await use_whole_kv_cache(engine)
        rss["awake"] = rss_bytes()
        report = await engine.sleep(level=level)
        rss["asleep"] = rss_bytes()
        await engine.wake_up()
        if level == 2:
            await engine.reload_weights()
        rss["woken"] = rss_bytes()
        await use_whole_kv_cache(engine)
        rss["used"] = rss_bytes()
    print(json.dumps({**rss, "freed": [report.freed_bytes.weights, report.freed_bytes.kv_cache]}))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""
"""An engine in a fresh interpreter: resident bytes awake (its whole KV cache written), asleep at ``level``,
woken (and, at level 2, reloaded), and in use again; and the bytes the sleep reported freed."""


def memory_readings(ckpt: Path, num_blocks: int, level: int) -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(ckpt), str(num_blocks), str(level)],
        cwd=root, capture_output=True, text=True, timeout=10 * TIMEOUT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    readings: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return readings


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~65 MB of embeddings + lm_head (vocab 32000 x hidden 256), 32 KiB per KV block."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "big", "llama", hidden_size=256, vocab_size=32000)


@pytest.fixture
async def engine(llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]) -> AsyncIterator[AsyncEngine]:
    async with make_engine(llama_ckpt) as engine:
        yield engine


# ---- outputs survive a sleep ---------------------------------------------------------------------------
async def test_level_1_greedy_outputs_after_wake_equal_those_before_sleep(engine: AsyncEngine) -> None:
    before = await token_ids(engine, PROMPTS, greedy())
    await engine.sleep(level=1)
    await engine.wake_up()
    assert await token_ids(engine, PROMPTS, greedy()) == before


async def test_level_2_greedy_outputs_after_wake_and_reload_equal_those_before_sleep(engine: AsyncEngine) -> None:
    before = await token_ids(engine, PROMPTS, greedy())
    await engine.sleep(level=2)
    await engine.wake_up()
    await engine.reload_weights()
    assert await token_ids(engine, PROMPTS, greedy()) == before


# ---- memory: freed for real, and reported exactly --------------------------------------------------------
def test_level_1_resident_memory_drops_by_the_kv_cache_and_rises_again_as_the_woken_cache_is_used(
    big_ckpt: Path,
) -> None:
    kv = kv_cache_bytes(big_ckpt, MEMORY_BLOCKS)
    rss = memory_readings(big_ckpt, MEMORY_BLOCKS, level=1)
    awake, asleep, woken, used = rss["awake"], rss["asleep"], rss["woken"], rss["used"]
    assert rss["freed"][1] == kv
    assert awake - asleep >= 0.8 * kv, f"resident memory dropped {awake - asleep} bytes; the KV cache is {kv}"
    # The woken cache is mapped, not yet resident: it takes memory as blocks are written.
    assert woken - asleep < 0.2 * kv, f"resident memory rose {woken - asleep} bytes on wake, before any use"
    assert used - asleep >= 0.8 * kv, f"resident memory rose {used - asleep} bytes in use; the KV cache is {kv}"


async def test_level_1_on_cpu_keeps_the_weights_in_host_memory_and_says_so(
    llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    async with make_engine(llama_ckpt) as engine:
        report = await engine.sleep(level=1)
    assert report.freed_bytes == TagBytes(weights=0, kv_cache=kv_cache_bytes(llama_ckpt, 512))
    assert any("host memory" in note for note in report.notes), report.notes


def test_level_2_resident_memory_drops_by_kv_cache_and_weights_and_rises_on_wake_and_reload(big_ckpt: Path) -> None:
    kv, weights = kv_cache_bytes(big_ckpt, LEVEL_2_BLOCKS), weight_bytes(big_ckpt)
    rss = memory_readings(big_ckpt, LEVEL_2_BLOCKS, level=2)
    awake, asleep, reloaded = rss["awake"], rss["asleep"], rss["used"]
    assert rss["freed"] == [weights, kv]
    assert awake - asleep >= 0.8 * (kv + weights), (
        f"resident memory dropped {awake - asleep} bytes; KV cache {kv} + weights {weights}"
    )
    assert reloaded - asleep >= 0.8 * (kv + weights), (
        f"resident memory rose {reloaded - asleep} bytes on wake + reload; KV cache {kv} + weights {weights}"
    )


# ---- staged wake ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", [["weights", "kv_cache"], ["kv_cache", "weights"]], ids="-then-".join)
async def test_a_half_awake_engine_runs_nothing_until_the_last_tag_wakes(engine: AsyncEngine, order: list[str]) -> None:
    expected = await token_ids(engine, PROMPTS[:1], greedy())
    await engine.sleep(level=1)
    await engine.wake_up(tags=[order[0]])
    assert await engine.is_sleeping()
    sink: list[RequestOutput] = []
    task = asyncio.create_task(final(engine, PROMPTS[0], greedy(), sink))
    await assert_queued_without_a_step(engine, sink)
    await engine.wake_up(tags=[order[1]])
    assert not await engine.is_sleeping()
    assert list((await task).token_ids) == expected[0]


async def test_wake_up_rejects_an_unknown_tag_by_name_and_changes_nothing(engine: AsyncEngine) -> None:
    expected = await token_ids(engine, PROMPTS[:1], greedy())
    await engine.sleep(level=1)
    with pytest.raises(ValueError, match="bogus"):
        await engine.wake_up(tags=["weights", "bogus"])
    assert engine.stats().sleeping == ("kv_cache", "weights")
    await engine.wake_up()
    assert await token_ids(engine, PROMPTS[:1], greedy()) == expected


async def test_after_level_2_a_woken_engine_refuses_to_run_until_weights_are_reloaded(engine: AsyncEngine) -> None:
    expected = await token_ids(engine, PROMPTS[:1], greedy())
    await engine.sleep(level=2)
    await engine.wake_up()
    assert not await engine.is_sleeping()
    assert engine.stats().weights_valid is False
    assert await engine.collective_rpc(lambda worker: worker.sleep_backend.weights_valid) == [False]
    sink: list[RequestOutput] = []
    task = asyncio.create_task(final(engine, PROMPTS[0], greedy(), sink))
    await assert_queued_without_a_step(engine, sink)
    await engine.reload_weights()
    assert engine.stats().weights_valid is True
    assert list((await task).token_ids) == expected[0]


# ---- idempotence and safety ------------------------------------------------------------------------------
async def test_sleep_while_asleep_is_a_no_op_that_says_so(engine: AsyncEngine) -> None:
    expected = await token_ids(engine, PROMPTS[:1], greedy())
    await engine.sleep(level=1)
    report = await engine.sleep(level=2)
    assert report.freed_bytes == TagBytes(weights=0, kv_cache=0)
    assert any("already asleep" in note for note in report.notes), report.notes
    assert engine.stats().weights_valid is True  # still the level 1 sleep: nothing was discarded
    await engine.wake_up()
    assert await token_ids(engine, PROMPTS[:1], greedy()) == expected  # the weights were kept


async def test_wake_up_while_awake_is_a_no_op_that_says_so(engine: AsyncEngine) -> None:
    expected = await token_ids(engine, PROMPTS[:1], greedy())
    report = await engine.wake_up()
    assert report.restored_bytes == TagBytes(weights=0, kv_cache=0)
    assert any("already awake" in note for note in report.notes), report.notes
    assert await token_ids(engine, PROMPTS[:1], greedy()) == expected


async def test_shutdown_while_asleep_completes(llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]) -> None:
    engine = make_engine(llama_ckpt)
    await engine.start()
    await engine.sleep(level=2)
    await asyncio.wait_for(engine.shutdown(), TIMEOUT)
    assert engine.stats().dead


async def test_shutdown_while_asleep_ends_the_requests_waiting_for_wake(
    llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    engine = make_engine(llama_ckpt)
    await engine.start()
    await engine.sleep(level=1)
    waiting = asyncio.create_task(final(engine, PROMPTS[0], greedy()))
    await wait_until(lambda: engine.stats().requests_waiting == 1, "the request queued")
    await asyncio.wait_for(engine.shutdown(), TIMEOUT)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(waiting, TIMEOUT)


async def test_two_engines_in_one_process_sleep_and_wake_independently(
    llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]
) -> None:
    async with make_engine(llama_ckpt) as a, make_engine(llama_ckpt) as b:
        expected = await token_ids(a, PROMPTS, greedy())
        await a.sleep(level=1)
        assert await token_ids(b, PROMPTS, greedy()) == expected  # b serves while a sleeps
        await b.sleep(level=2)
        await a.wake_up()
        assert await b.is_sleeping() and not await a.is_sleeping()
        assert await token_ids(a, PROMPTS, greedy()) == expected  # a serves while b sleeps
        await b.wake_up()
        await b.reload_weights()
        assert await token_ids(b, PROMPTS, greedy()) == expected


@pytest.mark.parametrize(
    "kwargs", [{"level": 0}, {"level": 3}, {"level": "1"}, {"mode": "later"}, {"mode": "ABORT"}], ids=str
)
async def test_invalid_sleep_level_or_mode_raises_value_error_and_the_engine_keeps_serving(
    engine: AsyncEngine, kwargs: dict[str, Any]
) -> None:
    expected = await token_ids(engine, PROMPTS[:1], greedy())
    with pytest.raises(ValueError, match=re.escape(repr(next(iter(kwargs.values()))))):
        await engine.sleep(**kwargs)
    assert not await engine.is_sleeping()
    assert await token_ids(engine, PROMPTS[:1], greedy()) == expected


async def test_sleep_wait_on_an_engine_paused_for_missing_weights_keeps_queued_requests(
    make_engine: Callable[..., AsyncEngine], llama_ckpt: Path
) -> None:
    # level 2, full wake, no reload: the core is paused; a queued request can never drain.
    async with make_engine(llama_ckpt) as engine:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        expected = (await final(engine, [5, 6, 7], params)).token_ids
        await engine.sleep(level=2)
        await engine.wake_up()
        queued = asyncio.create_task(final(engine, [5, 6, 7], params))
        await wait_until(lambda: engine.stats().requests_waiting == 1, "the request queued")
        report = await asyncio.wait_for(engine.sleep(level=1, mode="wait"), timeout=30)
        assert any("queued" in note for note in report.notes)
        assert not queued.done()
        await engine.wake_up()
        await engine.reload_weights()
        assert (await asyncio.wait_for(queued, timeout=30)).token_ids == expected
