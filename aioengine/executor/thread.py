"""ThreadExecutor: each worker lives on ONE dedicated thread.

Every call into a worker (execute_model and every RPC) is queued on that thread, so calls are
ordered and never run concurrently with a forward. The thread hands back concurrent futures,
which ``asyncio.wrap_future`` turns into awaitables; the event loop never blocks on the model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from aioengine.errors import AIOEngineError
from aioengine.executor.base import Executor
from aioengine.worker.wrapper import WorkerWrapper


class ThreadExecutor(Executor):
    """Single-process executor: one thread per worker rank (``tensor_parallel_size`` must be 1)."""

    def __init__(self, config: Any) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise AIOEngineError(
                "parallel.tensor_parallel_size > 1 needs a multi-process executor, which is not implemented yet"
            )
        self.config = config
        self.world_size = 1
        self._threads = [
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"aioengine-worker-{rank}")
            for rank in range(self.world_size)
        ]
        self._aside = concurrent.futures.ThreadPoolExecutor(max_workers=self.world_size,
                                                            thread_name_prefix="aioengine-aside")  # fmt: skip
        self.wrappers = [WorkerWrapper(rank) for rank in range(self.world_size)]
        self._closed = False
        # Build the workers on their own threads: device set-up is per thread on some back ends.
        for rank, wrapper in enumerate(self.wrappers):
            self._threads[rank].submit(wrapper.init_worker, config, rank).result()

    def _call(self, rank: int, method: str | Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> concurrent.futures.Future[Any]:  # fmt: skip
        if self._closed:
            raise AIOEngineError("executor is shut down")
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

    async def run_aside(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if self._closed:
            raise AIOEngineError("executor is shut down")
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
