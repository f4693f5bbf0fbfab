"""The HTTP server's admin endpoints while streams run: real sockets on 127.0.0.1, a real engine behind them.

``/sleep`` and ``/wake_up``, ``/pause`` and ``/resume``, ``/update_weights`` and ``/reload_weights`` in each of
their modes, ``/reset_prefix_cache``, each called while streams run: what the running streams get (finished,
aborted, frozen, carried onto new weights), what fresh requests get after (checked against a lone engine's
greedy output of checkpoint A or B), and the fingerprint each answer carries. Every wait is on the engine's
state (its stats, a stream's events), never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from aioengine import AsyncEngine, SamplingParams
from aioengine.engine.outputs import CompletionOutput
from tests.conftest import engine_config
from tests.helpers import last_output
from tests.server_support import (
    ADMIN,
    LONG,
    PROMPTS,
    SHORT,
    WAIT,
    LiveServer,
    Streamed,
    admin,
    assert_aborted,
    assert_finished,
    background,
    client_fixture,  # noqa: F401 - a fixture, by name
    complete,
    greedy,
    restored_fixture,  # noqa: F401 - a fixture, by name
    server_fixture,  # noqa: F401 - a fixture, by name
    stream,
    until,
    until_idle,
)

STREAM = 48
"""Tokens of a stream that must finish while a control call runs (long enough for the call to land mid-stream)."""

Refs = dict[str, dict[int, list[CompletionOutput]]]
"""``refs[checkpoint][max_tokens][prompt index]``: a lone engine's greedy output, checkpoint "A" or "B"."""


# ---- references ----------------------------------------------------------------------------------------
async def _reference(path: Path) -> dict[int, list[CompletionOutput]]:
    async with AsyncEngine(engine_config(path, cache={"num_blocks": 64})) as engine:
        refs = {}
        for n in (SHORT, STREAM):
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            outs = await asyncio.gather(*(last_output(engine.generate(p, params)) for p in PROMPTS))
            refs[n] = [out.outputs[0] for out in outs]
        return refs


@pytest.fixture(scope="module")
def refs(llama_ckpt: Path, ckpt_b: Path) -> Refs:
    """Checkpoint A (the servers' llama) and B (same shapes, other weights), each on an engine of its own."""
    refs = {"A": asyncio.run(_reference(llama_ckpt)), "B": asyncio.run(_reference(ckpt_b))}
    assert [o.text for o in refs["A"][SHORT]] != [o.text for o in refs["B"][SHORT]], "A and B must tell apart"
    return refs


# ---- requests ------------------------------------------------------------------------------------------
class Streams:
    """Streams run in background tasks; ``started`` returns once every one is generating."""

    def __init__(self, client: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> None:
        self.got = [Streamed() for _ in bodies]
        self.tasks = [background(stream(client, b, s)) for b, s in zip(bodies, self.got, strict=True)]

    async def started(self) -> None:
        async with asyncio.timeout(WAIT):
            await asyncio.gather(*(s.started.wait() for s in self.got))

    async def results(self) -> list[Streamed]:
        async with asyncio.timeout(WAIT):
            return await asyncio.gather(*self.tasks)


def running(client: httpx.AsyncClient, max_tokens: int) -> Streams:
    return Streams(client, [greedy(p, max_tokens) for p in PROMPTS])


async def outputs(client: httpx.AsyncClient) -> tuple[list[str], set[str]]:
    """Fresh greedy outputs of PROMPTS (SHORT tokens), one at a time, and the fingerprints they came with."""
    answers = [await complete(client, greedy(p, SHORT)) for p in PROMPTS]
    return [a["choices"][0]["text"] for a in answers], {a["system_fingerprint"] for a in answers}


def texts(refs: Refs, checkpoint: str, max_tokens: int = SHORT) -> list[str]:
    return [o.text for o in refs[checkpoint][max_tokens]]


# ==== admin control while streams run ===================================================================
async def is_sleeping(client: httpx.AsyncClient) -> bool:
    response = await client.get("/is_sleeping", headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()["is_sleeping"]


async def test_sleep_level_1_mode_wait_finishes_the_running_streams_then_sleeps_until_wake_up(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs
) -> None:
    streams = running(client, STREAM)
    await streams.started()
    response = await admin(client, "/sleep", level=1, mode="wait")
    assert response.status_code == 200, response.text
    got = await streams.results()
    assert_finished(got, STREAM)
    assert [s.text for s in got] == texts(refs, "A", STREAM)  # on the weights they started with, to the end
    assert await is_sleeping(client)
    assert (await admin(client, "/wake_up")).status_code == 200
    assert not await is_sleeping(client)
    assert (await outputs(client))[0] == texts(refs, "A")


async def test_sleep_level_2_mode_abort_ends_the_running_streams_and_reload_after_wake_up_serves_again(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs
) -> None:
    streams = running(client, LONG)
    await streams.started()
    response = await admin(client, "/sleep", level=2, mode="abort")
    assert response.status_code == 200, response.text
    assert response.json()["aborted"] == len(PROMPTS)
    assert_aborted(await streams.results())
    assert await is_sleeping(client)
    assert (await admin(client, "/wake_up")).status_code == 200
    assert not await is_sleeping(client)
    # Level 2 discarded the weights and /wake_up leaves them so (a trainer pushes new ones next); reload them.
    assert not restored.stats().weights_valid
    assert (await admin(client, "/reload_weights")).status_code == 200
    assert (await outputs(client))[0] == texts(refs, "A")


async def test_pause_mode_abort_ends_the_running_streams_and_holds_new_requests_until_resume(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs
) -> None:
    streams = running(client, LONG)
    await streams.started()
    response = await admin(client, "/pause", mode="abort")
    assert response.status_code == 200, response.text
    assert_aborted(await streams.results())
    later = background(complete(client, greedy(PROMPTS[0], SHORT)))
    await until(restored, lambda s: s.stats.paused and s.stats.requests_waiting == 1, "a request queued, paused")
    assert not later.done()
    assert (await admin(client, "/resume")).status_code == 200
    assert (await later)["choices"][0]["text"] == texts(refs, "A")[0]


async def test_pause_mode_wait_lets_the_running_streams_finish_first(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs
) -> None:
    streams = running(client, STREAM)
    await streams.started()
    response = await admin(client, "/pause", mode="wait")
    assert response.status_code == 200, response.text
    assert restored.stats().requests_running == 0  # the pause took hold once they had finished
    got = await streams.results()
    assert_finished(got, STREAM)
    assert [s.text for s in got] == texts(refs, "A", STREAM)
    assert restored.stats().paused
    assert (await admin(client, "/resume")).status_code == 200
    assert not restored.stats().paused


async def test_pause_mode_keep_freezes_the_running_streams_which_go_on_unchanged_after_resume(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs
) -> None:
    streams = running(client, STREAM)
    await streams.started()
    response = await admin(client, "/pause", mode="keep")
    assert response.status_code == 200, response.text
    frozen = restored.stats()
    assert frozen.paused and frozen.requests_running == len(PROMPTS), frozen  # held between two steps, with KV
    assert not any(task.done() for task in streams.tasks)
    assert (await admin(client, "/resume")).status_code == 200
    got = await streams.results()
    assert_finished(got, STREAM)
    assert [s.text for s in got] == texts(refs, "A", STREAM)


async def update_while_streaming(
    client: httpx.AsyncClient, path: Path, mode: str, max_tokens: int
) -> tuple[dict[str, Any], list[Streamed], str]:
    """Streams PROMPTS, updates the weights from ``path`` in ``mode`` while they run; returns the update's
    report, the streams and the fingerprint the server answered with just before."""
    before = (await complete(client, greedy(PROMPTS[0], 1)))["system_fingerprint"]
    streams = running(client, max_tokens)
    await streams.started()
    response = await admin(client, "/update_weights", path=str(path), mode=mode)
    assert response.status_code == 200, response.text
    return response.json(), await streams.results(), before


async def assert_serves(client: httpx.AsyncClient, refs: Refs, checkpoint: str, before: str, version: int) -> None:
    """Fresh answers are ``checkpoint``'s, and all carry one fingerprint: not the one from before the update, and
    naming its version."""
    after, prints = await outputs(client)
    assert after == texts(refs, checkpoint)
    assert len(prints) == 1 and before not in prints and next(iter(prints)).endswith(f"-w{version}"), (prints, before)


async def test_update_weights_mode_pause_swaps_under_the_running_streams_and_new_requests_get_the_new_weights(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs, ckpt_b: Path
) -> None:
    report, got, before = await update_while_streaming(client, ckpt_b, "pause", STREAM)
    assert_finished(got, STREAM)
    version = report["weights_version"]
    for s in got:  # each stream's first tokens came from the old weights, its last from the new
        assert len(s.fingerprints) == 2 and s.fingerprints[0] == before, s.fingerprints
        assert s.fingerprints[1].endswith(f"-w{version}"), s.fingerprints
    await assert_serves(client, refs, "B", before, version)


async def test_update_weights_mode_drain_finishes_the_running_streams_on_the_old_weights_first(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs, ckpt_b: Path
) -> None:
    report, got, before = await update_while_streaming(client, ckpt_b, "drain", STREAM)
    assert_finished(got, STREAM)
    assert [s.text for s in got] == texts(refs, "A", STREAM)
    assert all(s.fingerprints == [before] for s in got)
    await assert_serves(client, refs, "B", before, report["weights_version"])


async def test_update_weights_mode_abort_ends_the_running_streams(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs, ckpt_b: Path
) -> None:
    report, got, before = await update_while_streaming(client, ckpt_b, "abort", LONG)
    assert report["aborted"] == len(PROMPTS)
    assert_aborted(got)
    assert all(s.fingerprints == [before] for s in got)
    await assert_serves(client, refs, "B", before, report["weights_version"])


async def test_update_weights_mode_recompute_finishes_the_running_streams_on_the_new_weights(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs, ckpt_b: Path
) -> None:
    report, got, before = await update_while_streaming(client, ckpt_b, "recompute", STREAM)
    assert report["preempted"] == len(PROMPTS)
    assert_finished(got, STREAM)
    version = report["weights_version"]
    for s in got:  # begun on the old weights, ended on the new (their KV recomputed under them)
        assert s.fingerprints[0] == before and s.fingerprints[-1].endswith(f"-w{version}"), s.fingerprints
    await assert_serves(client, refs, "B", before, version)


async def test_reload_weights_brings_back_the_checkpoint_the_server_started_from(
    restored: LiveServer, client: httpx.AsyncClient, refs: Refs, ckpt_b: Path
) -> None:
    response = await admin(client, "/update_weights", path=str(ckpt_b))
    assert response.status_code == 200, response.text
    on_b, (before,) = await outputs(client)
    assert on_b == texts(refs, "B")
    streams = running(client, STREAM)
    await streams.started()
    response = await admin(client, "/reload_weights", mode="drain")
    assert response.status_code == 200, response.text
    got = await streams.results()
    assert_finished(got, STREAM)
    assert [s.text for s in got] == texts(refs, "B", STREAM)  # drained on B
    await assert_serves(client, refs, "A", before, response.json()["weights_version"])


async def test_reset_prefix_cache_is_refused_while_requests_run_unless_forced(
    restored: LiveServer, client: httpx.AsyncClient
) -> None:
    streams = running(client, LONG)
    await streams.started()
    refused = await admin(client, "/reset_prefix_cache")
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "engine_state" and "force" in refused.json()["error"]["message"]
    forced = await admin(client, "/reset_prefix_cache", force=True)
    assert forced.status_code == 200, forced.text
    assert isinstance(forced.json()["cached_blocks"], int)
    assert (await admin(client, "/pause", mode="abort")).status_code == 200
    assert_aborted(await streams.results())
    assert (await admin(client, "/resume")).status_code == 200
    await until_idle(restored)
    idle = await admin(client, "/reset_prefix_cache")
    assert idle.status_code == 200, idle.text
    assert restored.stats().prefix_cache_blocks == 0


async def test_an_update_from_a_missing_path_is_a_client_error_that_changes_nothing(
    restored: LiveServer, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    before = await outputs(client)
    version = restored.stats().weights_version
    response = await admin(client, "/update_weights", path=str(tmp_path / "missing"), mode="pause")
    assert await outputs(client) == before  # the same texts, under the same fingerprint
    assert restored.stats().weights_version == version
    assert "missing" in response.json()["error"]["message"]
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
