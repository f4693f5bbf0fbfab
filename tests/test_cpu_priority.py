"""Work run beside serving on a thread made for it, at the OS's idle priority or not (``worker.cpu_priority``),
and the weight staging that runs there (``load.staging_priority``)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from aioengine import AsyncEngine
from aioengine.worker import cpu_priority
from aioengine.worker import worker as worker_module
from tests.weight_swap_support import FEW, token_ids

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")


def where() -> tuple[int, str, int | None]:
    """The calling thread's id, name and scheduling policy (None where the OS has no such call)."""
    policy = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
    return threading.get_ident(), threading.current_thread().name, policy


def test_normal_priority_runs_the_work_on_a_thread_of_its_own_in_the_caller_s_policy() -> None:
    ident, name, policy = cpu_priority.run_at_priority("normal", where, "aioengine-staging")
    assert ident != threading.get_ident() and name.startswith("aioengine-staging") and policy == where()[2]


def test_the_work_s_thread_ends_with_it() -> None:
    # A thread that ran a parallel torch op keeps an OpenMP team while it lives (cpu_priority's docstring).
    for priority in ("idle", "normal"):
        thread = cpu_priority.run_at_priority(priority, threading.current_thread, "aside")
        assert thread is not threading.current_thread()
        thread.join(timeout=10)
        assert not thread.is_alive()


@linux_only
def test_idle_priority_runs_the_work_on_a_thread_of_its_own_in_sched_idle() -> None:
    ident, name, policy = cpu_priority.run_at_priority("idle", where, "aioengine-staging")
    assert ident != threading.get_ident() and name.startswith("aioengine-staging")
    assert policy == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own policy is left as it was


def test_an_error_of_the_work_reaches_the_caller() -> None:
    def fails() -> None:
        raise ValueError("bad tensor")

    for priority in ("idle", "normal"):
        with pytest.raises(ValueError, match="bad tensor"):
            cpu_priority.run_at_priority(priority, fails, "aside")


def test_where_the_os_refuses_the_policy_the_work_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise PermissionError("not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse, raising=False)
    ident, _, _ = cpu_priority.run_at_priority("idle", where, "aside")
    assert ident != threading.get_ident()


@linux_only
@pytest.mark.parametrize("priority", ["idle", "normal"])
async def test_staged_weights_are_read_at_the_configured_priority(
    make_engine: Callable[..., AsyncEngine],
    llama_ckpt: Path,
    ckpt_b: Path,
    ref: dict[str, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
    priority: str,
) -> None:
    policies: list[int] = []
    stage = worker_module.stage_weights

    def recording(*args: object, **kwargs: object) -> object:
        policies.append(os.sched_getscheduler(0))
        return stage(*args, **kwargs)

    monkeypatch.setattr(worker_module, "stage_weights", recording)
    async with make_engine(llama_ckpt, load={"staging_priority": priority}) as engine:
        await engine.update_weights(ckpt_b, stage=True)
        assert await token_ids(engine) == ref["B"][:FEW]
    assert policies == [os.SCHED_IDLE if priority == "idle" else os.SCHED_OTHER]
