"""The worker layer of the seeds: collective_rpc, extensions, faults, profiling (padded decode buckets:
test_padded_decode.py)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from aioengine.errors import (
    AIOEngineError,
    ConfigurationError,
    EngineDeadError,
    EngineNotStartedError,
    EngineStateError,
)
from aioengine.messages import TagBytes, WorkerSleepReport, WorkerWakeReport, WorkerWeightsReport
from aioengine.worker.cpu_worker import CPUWorker
from tests.helpers import TIMEOUT, final, wait_until

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
EXT = "tests.worker_extensions.EchoExtension"


async def _collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return (await final(engine, prompt, params)).token_ids


# ---- collective_rpc --------------------------------------------------------------------------------
async def test_collective_rpc_by_name_returns_one_result_per_rank(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt, parallel={"worker_extension_cls": EXT}) as engine:
        assert await engine.collective_rpc("echo_rank", args=("!",)) == ["rank0!"]
        assert await engine.collective_rpc("echo_rank", kwargs={"suffix": "?"}, unique_reply_rank=0) == "rank0?"


async def test_collective_rpc_with_a_callable_gets_the_worker(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt) as engine:
        kinds = await engine.collective_rpc(lambda worker, n: (type(worker).__name__, worker.rank + n), args=(10,))
        assert kinds == [("CPUWorker", 10)]


async def test_collective_rpc_timeout_names_the_method_and_engine_keeps_serving(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt, parallel={"worker_extension_cls": EXT}) as engine:
        with pytest.raises(TimeoutError, match="sleep_for"):
            await engine.collective_rpc("sleep_for", args=(1.0,), timeout=0.1)
        assert len(await _collect(engine, [5, 6, 7])) == GREEDY.max_tokens


async def test_a_timed_out_rpc_is_reported_overdue_until_it_returns(make_engine, llama_ckpt: Path) -> None:
    # The thread executor: the timed-out call keeps the worker's thread, check_health names it meanwhile, and
    # the record ends when the call returns.
    release = threading.Event()

    def hold_the_worker(worker: Any) -> str:
        release.wait(TIMEOUT)
        return "done"

    async with make_engine(llama_ckpt) as engine:
        with pytest.raises(TimeoutError, match="hold_the_worker"):
            await engine.collective_rpc(hold_the_worker, timeout=0.05)
        assert [call for call in engine.executor.overdue_calls() if "hold_the_worker" in call]
        with pytest.raises(EngineStateError, match="hold_the_worker"):
            await engine.check_health()
        release.set()
        await wait_until(lambda: not engine.executor.overdue_calls(), "done with the timed-out call")
        await engine.check_health()
        assert len(await _collect(engine, [5, 6, 7])) == GREEDY.max_tokens


async def test_collective_rpc_exception_surfaces_and_engine_keeps_serving(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt, parallel={"worker_extension_cls": EXT}) as engine:
        with pytest.raises(ValueError, match="bad thing 42"):
            await engine.collective_rpc("raise_value_error", args=("bad thing 42",))
        assert len(await _collect(engine, [5, 6, 7])) == GREEDY.max_tokens
        await engine.check_health()


def record_steps(worker: Any, log: list[tuple[str, int, str]]) -> None:
    """From now on every step's forward appends ("step", step id, thread name) to ``log`` on the worker."""
    execute_model = worker.execute_model

    def recorded(scheduler_output: Any) -> Any:
        log.append(("step", scheduler_output.step_id, threading.current_thread().name))
        return execute_model(scheduler_output)

    worker.execute_model = recorded  # an instance attribute shadows the method


async def test_collective_rpc_runs_in_order_with_steps_on_the_worker_thread(make_engine, llama_ckpt: Path) -> None:
    # Steps and RPCs must run on the worker in the order the loop submitted them: an RPC sent between
    # two steps sees the first one done and the second one not started.
    async with make_engine(llama_ckpt) as engine:
        ran: list[tuple[str, int, str]] = []  # appended on the worker thread
        await engine.collective_rpc(record_steps, args=(ran,))
        submitted: list[tuple[str, int]] = []  # appended on the loop, at submission
        withdrawn: set[int] = set()  # steps an RPC took back before they ran (they are scheduled again)
        step_of: dict[Any, int] = {}
        submit_step, withdraw_step = engine.executor.submit_step, engine.executor.withdraw_step

        def submit(scheduler_output: Any) -> Any:
            submitted.append(("step", scheduler_output.step_id))
            step_of[future := submit_step(scheduler_output)] = scheduler_output.step_id
            return future

        def withdraw(step: Any) -> bool:
            if not withdraw_step(step):
                return False
            withdrawn.add(step_of[step])
            return True

        engine.executor.submit_step = submit  # type: ignore[method-assign]
        engine.executor.withdraw_step = withdraw  # type: ignore[method-assign]

        async def rpc(i: int) -> None:
            submitted.append(("rpc", i))  # collective_rpc queues the call before its first await
            await engine.collective_rpc(lambda w: ran.append(("rpc", i, threading.current_thread().name)))

        async def two_more_steps() -> None:
            steps = sum(kind == "step" for kind, _, _ in ran)
            await wait_until(lambda: sum(kind == "step" for kind, _, _ in ran) >= steps + 2, "two more steps run")

        params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
        gen = asyncio.create_task(final(engine, [5, 6, 7], params, request_id="long"))
        for i in range(3):
            await two_more_steps()
            await rpc(i)
        await two_more_steps()
        await engine.abort("long")
        assert (await gen).finish_reason == "abort"
        await rpc(3)  # queued behind every step submitted so far: when it returns, all of them ran

    submitted = [(kind, n) for kind, n in submitted if not (kind == "step" and n in withdrawn)]
    # A decode window runs its steps back to back under one step id: one submission, one entry.
    ran = [entry for i, entry in enumerate(ran) if i == 0 or entry[:2] != ran[i - 1][:2]]
    assert [(kind, n) for kind, n, _ in ran] == submitted
    for i in range(3):  # each of the first three ran between two steps, mid-generation
        at = submitted.index(("rpc", i))
        assert submitted[at - 1][0] == "step" and submitted[at + 1][0] == "step", submitted
    step_ids = [n for kind, n in submitted if kind == "step"]
    assert step_ids == sorted(step_ids) and len(set(step_ids)) == len(step_ids)
    threads = {name for _, _, name in ran}
    assert len(threads) == 1 and threads.pop().startswith("aioengine-worker-0")


# ---- extensions --------------------------------------------------------------------------------------
async def test_extension_clash_fails_at_startup_naming_the_attribute(make_engine, llama_ckpt: Path) -> None:
    engine = make_engine(llama_ckpt, parallel={"worker_extension_cls": "tests.worker_extensions.ClashingExtension"})
    with pytest.raises(AIOEngineError, match="load_model"):
        await engine.start()
    await engine.shutdown()


async def test_extension_clash_in_a_composed_mixin_is_found_too(make_engine, llama_ckpt: Path) -> None:
    qualname = "tests.worker_extensions.ComposedClashingExtension"
    engine = make_engine(llama_ckpt, parallel={"worker_extension_cls": qualname})
    with pytest.raises(AIOEngineError, match="load_model"):
        await engine.start()
    await engine.shutdown()


async def test_two_engines_with_different_extensions_stay_separate(make_engine, llama_ckpt: Path) -> None:
    async with (
        make_engine(llama_ckpt, parallel={"worker_extension_cls": EXT}) as a,
        make_engine(llama_ckpt, parallel={"worker_extension_cls": "tests.worker_extensions.OtherExtension"}) as b,
    ):
        assert await a.collective_rpc("echo_rank") == ["rank0"]
        assert await b.collective_rpc("other_method") == ["other"]
        with pytest.raises(AttributeError):
            await a.collective_rpc("other_method")
        with pytest.raises(AttributeError):
            await b.collective_rpc("echo_rank")
    assert not hasattr(CPUWorker, "echo_rank") and not hasattr(CPUWorker, "other_method")


async def test_worker_cls_override_can_act_between_forward_and_sampling(make_engine, llama_ckpt: Path) -> None:
    async with make_engine(llama_ckpt, parallel={"worker_cls": "tests.worker_extensions.ForcedTokenWorker"}) as engine:
        assert await _collect(engine, [5, 6, 7]) == [7] * GREEDY.max_tokens


# ---- faults and health ---------------------------------------------------------------------------
async def test_worker_fault_mid_generation_ends_every_request_with_an_error(make_engine, llama_ckpt: Path) -> None:
    engine = make_engine(llama_ckpt)
    await engine.start()
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    streams: list[list[RequestOutput]] = [[] for _ in range(6)]

    async def consume(i: int) -> None:
        async for out in engine.generate([5 + i, 6, 7], params):
            streams[i].append(out)

    tasks = [asyncio.create_task(consume(i)) for i in range(6)]
    await wait_until(lambda: all(streams), "every request has an output")

    def boom(*args: object) -> None:
        raise RuntimeError("injected device fault")

    await engine.collective_rpc(lambda w: setattr(w.model_runner, "execute_model", boom))
    at_fault = engine.stats().num_generated_tokens
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=TIMEOUT)
    assert all(isinstance(r, EngineDeadError) and "injected device fault" in str(r) for r in results), results
    # Promptly: the first step queued behind the fault fails. Only the two steps queued ahead of it (the
    # running one and, with async scheduling, the next) may still publish a token per request, not the
    # ~190 each had left.
    assert engine.stats().num_generated_tokens - at_fault <= 2 * len(tasks)
    assert all(not s[-1].finished and len(s[-1].token_ids) < params.max_tokens for s in streams)
    assert engine.stats().dead and not engine.is_awake
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await _collect(engine, [1, 2, 3])
    with pytest.raises(EngineDeadError):
        await engine.collective_rpc(lambda w: None)
    with pytest.raises(EngineDeadError):
        await engine.sleep()
    await asyncio.wait_for(engine.shutdown(), timeout=TIMEOUT)
    await engine.shutdown()


async def test_check_health_passes_on_a_serving_engine(llama_engine: AsyncEngine) -> None:
    await llama_engine.check_health()
    assert len(await _collect(llama_engine, [5, 6, 7])) == GREEDY.max_tokens
    await llama_engine.check_health()


@pytest.mark.parametrize("level", [1, 2])
async def test_check_health_passes_on_a_sleeping_engine(llama_engine: AsyncEngine, level: int) -> None:
    # Asleep, the worker holds no KV cache (and after level 2 no weights) by design: that is healthy.
    await llama_engine.sleep(level=level)
    await llama_engine.check_health()


async def test_check_health_raises_when_an_awake_worker_lost_its_kv_cache(llama_engine: AsyncEngine) -> None:
    await llama_engine.collective_rpc(lambda w: w.model_runner.release_kv_cache())
    with pytest.raises(AIOEngineError, match="no KV cache"):
        await llama_engine.check_health()


async def test_check_health_raises_engine_dead_error_after_shutdown(make_engine, llama_ckpt: Path) -> None:
    engine = make_engine(llama_ckpt)
    await engine.start()
    await engine.check_health()
    await engine.shutdown()
    with pytest.raises(EngineDeadError):
        await engine.check_health()


# ---- profiling ---------------------------------------------------------------------------------------
async def test_profile_without_a_dir_says_which_option_to_set(llama_engine: AsyncEngine) -> None:
    with pytest.raises(RuntimeError, match=r"profiler\.dir"):
        await llama_engine.start_profile()


async def test_profile_writes_a_trace(make_engine, llama_ckpt: Path, tmp_path: Path) -> None:
    async with make_engine(llama_ckpt, profiler={"dir": str(tmp_path)}) as engine:
        await engine.start_profile()
        await _collect(engine, [5, 6, 7])
        assert await engine.stop_profile() == [str(tmp_path)]
    assert any(p.name.endswith(".json") or ".pt.trace" in p.name for p in tmp_path.iterdir())


# ---- KV cache sizing on CPU ------------------------------------------------------------------------
async def test_cpu_kv_cache_takes_the_configured_bytes(make_engine, llama_ckpt: Path) -> None:
    budget = 3 << 20
    async with make_engine(llama_ckpt, cache={"num_blocks": None, "kv_cache_memory_bytes": budget}) as engine:
        block_bytes = await engine.collective_rpc("get_cache_block_size_bytes", unique_reply_rank=0)
        assert engine.stats().kv_blocks_total == budget // block_bytes - 1  # one block is the null block


async def test_cpu_kv_cache_larger_than_free_memory_fails_at_start_naming_the_option(
    make_engine, llama_ckpt: Path
) -> None:
    engine = make_engine(llama_ckpt, cache={"num_blocks": None, "kv_cache_memory_bytes": 1 << 50})
    with pytest.raises(AIOEngineError, match="kv_cache_memory_bytes"):
        await engine.start()
    await engine.shutdown()


# ---- start-up refusals ---------------------------------------------------------------------------
def engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("aioengine")}


async def test_an_executor_that_is_not_built_yet_is_refused_at_start_naming_the_setting_and_leaves_no_thread(
    make_engine, llama_ckpt: Path
) -> None:
    before = engine_threads()
    engine = make_engine(llama_ckpt, parallel={"tensor_parallel_size": 2})
    with pytest.raises(ConfigurationError, match="tensor_parallel_size=2: the thread executor runs one worker; set "):
        await engine.start()
    assert engine_threads() - before == set(), "a failed start left a worker thread behind"
    assert not engine.stats().started
    with pytest.raises(EngineNotStartedError):
        await _collect(engine, [1, 2, 3])
    await engine.shutdown()


# ---- reports of several ranks ----------------------------------------------------------------------
def test_sleep_reports_of_two_ranks_merge_bytes_added_seconds_of_the_slowest_notes_once() -> None:
    rank0 = WorkerSleepReport(TagBytes(weights=100, kv_cache=10), 0.5, ("level 1 on a CPU device", "a"))
    rank1 = WorkerSleepReport(TagBytes(weights=300, kv_cache=30), 0.25, ("a", "b"))
    assert WorkerSleepReport.merge([rank0, rank1]) == WorkerSleepReport(
        TagBytes(weights=400, kv_cache=40), 0.5, ("level 1 on a CPU device", "a", "b")
    )


def test_wake_reports_of_two_ranks_merge_a_tag_asleep_on_any_rank_as_asleep() -> None:
    rank0 = WorkerWakeReport(TagBytes(weights=100), 0.25, graph_capture_seconds=0.125, asleep=("kv_cache",),
                             notes=("x",))  # fmt: skip
    rank1 = WorkerWakeReport(TagBytes(weights=300, kv_cache=7), 0.75, graph_capture_seconds=0.0, asleep=(),
                             notes=("x", "y"))  # fmt: skip
    assert WorkerWakeReport.merge([rank0, rank1]) == WorkerWakeReport(
        TagBytes(weights=400, kv_cache=7), 0.75, graph_capture_seconds=0.125, asleep=("kv_cache",), notes=("x", "y")
    )
    both = WorkerWakeReport.merge([
        WorkerWakeReport(TagBytes(), 0.0, asleep=("kv_cache",)), WorkerWakeReport(TagBytes(), 0.0, asleep=("weights",))
    ])  # fmt: skip
    assert both.asleep == ("weights", "kv_cache")  # every tag asleep somewhere, in WAKE_TAGS order
    assert WorkerWakeReport.merge([rank1, rank1]).asleep == ()


def test_weights_reports_of_two_ranks_merge_tensors_of_rank_0_bytes_added_newest_version_valid_on_all() -> None:
    # Every rank reads the same checkpoint tensors (each keeps its shard): counting them twice would be wrong.
    rank0 = WorkerWeightsReport(tensors=12, bytes=1000, seconds=0.5, weights_version=3, weights_valid=True)
    rank1 = WorkerWeightsReport(tensors=12, bytes=800, seconds=1.5, weights_version=4, weights_valid=False)
    assert WorkerWeightsReport.merge([rank0, rank1]) == WorkerWeightsReport(
        tensors=12, bytes=1800, seconds=1.5, weights_version=4, weights_valid=False
    )
    assert WorkerWeightsReport.merge([rank0, rank0]).weights_valid is True
    assert WorkerWeightsReport.merge([rank0, rank1]).weights_valid is False  # serving needs every rank's weights
