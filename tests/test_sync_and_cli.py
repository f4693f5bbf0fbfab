"""The blocking facade, the CLI, and running on uvloop."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from aioengine import AsyncEngine, Engine, SamplingParams
from aioengine.cli import main as cli_main
from aioengine.errors import EngineDeadError
from tests.conftest import engine_config
from tests.helpers import TIMEOUT, final

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


async def _greedy_async(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    async with AsyncEngine(engine_config(path, cache={"num_blocks": 64})) as engine:
        return [o.token_ids for o in await asyncio.gather(*(final(engine, p, GREEDY) for p in prompts))]


def test_sync_engine_returns_final_outputs_in_prompt_order(llama_ckpt: Path) -> None:
    prompts = [[5, 6, 7], [100, 200, 300, 400, 5], [42]]
    expected = asyncio.run(_greedy_async(llama_ckpt, prompts))
    with Engine(engine_config(llama_ckpt, cache={"num_blocks": 64})) as engine:
        outs = engine.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == expected
        assert all(o.finished and o.finish_reason == "length" for o in outs)
        # Each request ran final_only: its one output's deltas are the whole of it.
        assert all(o.delta_token_ids == o.token_ids and o.delta_text == o.text for o in outs)
        assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_sync_engine_accepts_a_single_string_prompt(llama_ckpt: Path) -> None:
    with Engine(engine_config(llama_ckpt, cache={"num_blocks": 64})) as engine:
        (out,) = engine.generate("Hello world", GREEDY, use_tqdm=False)
        assert len(out.token_ids) == 8 and out.prompt_token_ids


def test_sync_engine_close_stops_the_engine_and_every_thread_it_started_and_is_idempotent(llama_ckpt: Path) -> None:
    before = set(threading.enumerate())
    engine = Engine(engine_config(llama_ckpt, cache={"num_blocks": 64}))
    started = set(threading.enumerate()) - before
    names = {t.name for t in started}
    assert "aioengine-loop" in names and any(name.startswith("aioengine-worker") for name in names), names
    engine.close()
    for thread in started:
        thread.join(timeout=TIMEOUT)  # a thread told to stop may take a moment to return
    assert [t.name for t in started if t.is_alive()] == []
    assert engine.stats().dead
    engine.close()  # a second close returns (and changes nothing)
    assert engine.stats().dead


def test_sync_engine_generate_after_close_raises_engine_dead_error(llama_ckpt: Path) -> None:
    engine = Engine(engine_config(llama_ckpt, cache={"num_blocks": 64}))
    engine.close()
    with pytest.raises(EngineDeadError):
        engine.generate([1, 2, 3], GREEDY, use_tqdm=False)


def test_engine_runs_on_uvloop(llama_ckpt: Path) -> None:
    uvloop = pytest.importorskip("uvloop")
    prompts = [[5, 6, 7], [9, 10]]
    expected = asyncio.run(_greedy_async(llama_ckpt, prompts))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(_greedy_async(llama_ckpt, prompts)) == expected


async def test_shutdown_is_idempotent_and_refuses_new_requests(llama_ckpt: Path) -> None:
    engine = AsyncEngine(engine_config(llama_ckpt, cache={"num_blocks": 64}))
    await engine.start()
    await engine.shutdown()
    await engine.shutdown()
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate([1, 2, 3], GREEDY):
            pass


def test_cli_generate_streams_and_reports_tokens_per_second(
    llama_ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli_main(["generate", "--model", str(llama_ckpt), "--prompt", "Hello", "--max-tokens", "6",
                   "--temperature", "0", "--device", "cpu"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("Hello")
    assert "tokens/s" in out.splitlines()[-1]


def test_cli_demo_runs_every_step_on_the_random_init_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    # The real default model is covered by tests/test_real_model.py; here the quick random-init one.
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AIOENGINE_DEFAULT_MODEL", "random")
    rc = cli_main(["demo", "--max-tokens", "4", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tokens from 5 requests" in out
    for step in ("sleep(level=1)", "sleep(level=2)", "the same answer as before: True", "weights_version 2",
                 "the same as before: True", "Summary", "output tokens/s"):  # fmt: skip
        assert step in out, step
    assert any(tmp_path.iterdir()), "the demo model is cached under AIOENGINE_CACHE_DIR"
