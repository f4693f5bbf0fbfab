"""ThreadExecutor: each worker lives on ONE dedicated thread.

Every call into a worker (execute_model and every RPC) is queued on that thread, so calls are
ordered and never run concurrently with a forward. The thread hands back concurrent futures,
which ``asyncio.wrap_future`` turns into awaitables; the event loop never blocks on the model.

Worker and loop share one interpreter, so they share the GIL; the one habit that follows from
that lives here too (see ``_step_done``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable
from typing import Any

from aioengine.errors import ConfigurationError, EngineDeadError
from aioengine.executor.base import Executor, execute_and_sample
from aioengine.messages import ModelRunnerOutput, SchedulerOutput
from aioengine.worker.wrapper import WorkerWrapper

_yield_gil: Callable[[], None] = getattr(os, "sched_yield", lambda: None)  # releases GIL and CPU (not on Windows)


class ThreadExecutor(Executor):
    """Single-process executor: one thread per worker rank (``tensor_parallel_size`` must be 1)."""

    def __init__(self, config: Any) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ConfigurationError(
                f"parallel.tensor_parallel_size={config.parallel.tensor_parallel_size} needs a multi-process "
                "executor (parallel.distributed_executor_backend='mp' or 'ray'), which is not built yet; "
                "use tensor_parallel_size=1 with the thread executor"
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
        self._steps_queued = 0
        """Steps submitted whose outputs have not come back to the loop yet."""
        # Build the workers on their own threads: device set-up is per thread on some back ends.
        for rank, wrapper in enumerate(self.wrappers):
            self._threads[rank].submit(wrapper.init_worker, config, rank).result()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("the executor is shut down; create a new engine")

    def _call(
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
        futures = [asyncio.wrap_future(self._call(rank, method, args, kwargs or {})) for rank in range(self.world_size)]
        name = method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
        try:
            results = await asyncio.wait_for(asyncio.gather(*futures), timeout)
        except TimeoutError:
            raise TimeoutError(f"collective_rpc {name!r} timed out after {timeout}s") from None
        return results[unique_reply_rank] if unique_reply_rank is not None else results

    def submit_step(self, scheduler_output: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        # One rank: its output is the step's. Queued on the worker's thread right here, so the step is
        # ordered with every call submitted before and after it, and starts while the loop goes on.
        output: asyncio.Future[ModelRunnerOutput] = asyncio.wrap_future(
            self._call(0, execute_and_sample, (scheduler_output,), {})
        )
        self._steps_queued += 1
        output.add_done_callback(self._step_done)  # before anyone awaits it: runs first
        return output

    def _step_done(self, _: asyncio.Future[ModelRunnerOutput]) -> None:
        self._steps_queued -= 1
        if self._steps_queued:
            # The worker finished a step and has the next one queued, but it woke the loop by finishing
            # and would wait for the GIL while the loop applies this step's outputs (1.2-1.5 ms a step on
            # 2 cores). Yielding first lets the worker start the next step; the loop waits for that.
            _yield_gil()

    async def run_aside(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self._check_open()
        calls = [self._aside.submit(lambda w=w: getattr(w, method)(*args)) for w in self.wrappers]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in calls)))

    def shutdown(self) -> None:
        if self._closed:
            return
        for rank, wrapper in enumerate(self.wrappers):
            if wrapper.worker is not None:
                try:
                    self._threads[rank].submit(wrapper.worker.shutdown).result(timeout=60)
                except Exception:  # noqa: BLE001 - shutdown must complete even if a worker is broken
                    pass
        self._closed = True
        for thread in [*self._threads, self._aside]:
            thread.shutdown(wait=False, cancel_futures=True)
