"""ThreadExecutor: each worker lives on ONE dedicated thread.

Every call into a worker (execute_model and every RPC) is queued on that thread, so calls are
ordered and never run concurrently with a forward. The thread hands back concurrent futures,
which ``bridge`` turns into awaitables; the event loop never blocks on the model. One thread is
one lane: an RPC that outlives its timeout still holds it, and steps wait behind it
(``overdue_calls`` says so, and ``check_health`` fails meanwhile).

Worker and loop share one interpreter, so they share the GIL; the one habit that follows from
that lives here too (see ``_step_done``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Callable
from typing import Any

from aioengine.errors import ConfigurationError, EngineDeadError
from aioengine.executor.base import (
    Executor,
    OverdueCalls,
    bridge,
    call_name,
    execute_and_sample,
    gather_replies,
)
from aioengine.messages import ModelRunnerOutput, SchedulerOutput
from aioengine.worker.wrapper import WorkerWrapper

logger = logging.getLogger(__name__)


_yield_gil: Callable[[], None] = getattr(os, "sched_yield", lambda: None)  # releases GIL and CPU (not on Windows)


class ThreadExecutor(Executor):
    """Single-process executor: one thread per worker rank (``tensor_parallel_size`` must be 1)."""

    def __init__(self, config: Any) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ConfigurationError(
                f"parallel.tensor_parallel_size={config.parallel.tensor_parallel_size}: the thread executor runs "
                "one worker; set parallel.distributed_executor_backend='mp' (a process per rank) for tensor "
                "parallelism"
            )
        self.config = config
        self.world_size = 1
        self._threads = [
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"aioengine-worker-{rank}")
            for rank in range(self.world_size)
        ]
        self._aside = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.world_size, thread_name_prefix="aioengine-aside"
        )
        self.wrappers = [WorkerWrapper(rank) for rank in range(self.world_size)]
        self._closed = False
        self._step_calls: dict[asyncio.Future[ModelRunnerOutput], concurrent.futures.Future[Any]] = {}
        """Steps submitted whose outputs have not come back to the loop yet, with their calls on the thread."""
        self._overdue = OverdueCalls()
        # Build the workers on their own threads: device set-up is per thread on some back ends.
        for rank, wrapper in enumerate(self.wrappers):
            self._threads[rank].submit(wrapper.init_worker, config, rank).result()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("the executor is shut down; create a new engine")

    def _call(
        self, rank: int, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> asyncio.Future[Any]:
        return bridge(self._submit(rank, method, args, kwargs))

    def _submit(
        self, rank: int, method: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> concurrent.futures.Future[Any]:
        self._check_open()
        wrapper = self.wrappers[rank]
        if isinstance(method, str):
            return self._threads[rank].submit(lambda: getattr(wrapper, method)(*args, **kwargs))
        return self._threads[rank].submit(lambda: method(wrapper.worker, *args, **kwargs))

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        futures = [self._call(rank, method, args, kwargs or {}) for rank in range(self.world_size)]
        name = call_name(method)
        return await gather_replies(futures, name, timeout, unique_reply_rank, self._overdue, "on the worker thread")

    def overdue_calls(self) -> list[str]:
        return self._overdue.describe()

    def submit_step(self, scheduler_output: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        # One rank: its output is the step's. Queued on the worker's thread right here, so the step is
        # ordered with every call submitted before and after it, and starts while the loop goes on.
        call = self._submit(0, execute_and_sample, (scheduler_output,), {})
        output: asyncio.Future[ModelRunnerOutput] = bridge(call)
        self._step_calls[output] = call
        output.add_done_callback(self._step_done)  # before anyone awaits it: runs first
        return output

    def withdraw_step(self, step: asyncio.Future[ModelRunnerOutput]) -> bool:
        # A call the thread has not taken yet can be cancelled; the thread then skips it.
        call = self._step_calls.get(step)
        return call is not None and call.cancel()

    def _step_done(self, output: asyncio.Future[ModelRunnerOutput]) -> None:
        self._step_calls.pop(output, None)
        if self._step_calls:
            # The worker finished a step and has the next one queued, but it woke the loop by finishing
            # and would wait for the GIL while the loop applies this step's outputs (1.2-1.5 ms a step on
            # 2 cores). Yielding first lets the worker start the next step; the loop waits for that.
            _yield_gil()

    async def run_aside(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self._check_open()

        def call(wrapper: WorkerWrapper) -> Any:
            return getattr(wrapper, method)(*args)

        calls = [bridge(self._aside.submit(call, w)) for w in self.wrappers]
        return list(await asyncio.gather(*calls))

    def shutdown(self) -> None:
        if self._closed:
            return
        reaped = True
        for rank, wrapper in enumerate(self.wrappers):
            if wrapper.worker is not None:
                try:
                    self._threads[rank].submit(wrapper.worker.shutdown).result(timeout=60)
                except concurrent.futures.TimeoutError:
                    reaped = False  # a call that never returns holds the thread: do not wait for it
                except Exception:  # shutdown must complete even if a worker is broken
                    logger.exception("worker rank %d failed to shut down cleanly", rank)
        self._closed = True
        for thread in [*self._threads, self._aside]:
            # Once the workers' own shutdown ran, their threads have nothing left: wait for them, so no
            # thread outlives the engine.
            thread.shutdown(wait=reaped, cancel_futures=True)
