"""AsyncEngine: the public asyncio API. Works on any asyncio loop (uvloop in the CLI)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from aioengine.config import EngineConfig
from aioengine.engine.core import EngineCore
from aioengine.engine.lifecycle import SleepAndWeightsMixin
from aioengine.engine.outputs import RequestOutput
from aioengine.errors import EngineDeadError, EngineNotStartedError, InvalidRequestError, RequestTooLargeError
from aioengine.executor.base import Executor
from aioengine.messages import KVCacheConfig
from aioengine.sampling.params import SamplingParams
from aioengine.scheduler.request import Request
from aioengine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


class AsyncEngine(SleepAndWeightsMixin):
    """Continuous-batching generation inside your own event loop.

    ``async with AsyncEngine(config) as engine:`` starts the worker (model load, KV cache,
    warm-up) and shuts it down on exit. Every ``generate()`` stream is independent; cancelling
    the task that consumes one aborts that request and frees its KV blocks.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        self.config = config if config is not None else EngineConfig(**overrides)
        if config is not None and overrides:
            raise TypeError("pass either an EngineConfig or keyword sections, not both")
        self.executor: Executor | None = None
        self.core: EngineCore | None = None
        self.tokenizer: Any = None
        self.model_info: dict[str, Any] = {}
        self.num_blocks = 0
        self._started = False
        self._closed = False
        self._start_lock = asyncio.Lock()
        self._control_lock = asyncio.Lock()  # one sleep / wake / weight update at a time
        self._asleep: set[str] = set()
        self._sleep_level = 0
        self.weights_valid = True
        """False after sleep level 2 until weights are loaded again; no step runs meanwhile."""

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Builds the executor and runs the worker lifecycle of the seeds through collective_rpc."""
        async with self._start_lock:
            if self._started:
                return
            if self._closed:
                raise EngineDeadError("engine was shut down; create a new one")
            started = time.perf_counter()
            self.config = await asyncio.to_thread(_with_model_path, self.config)
            self.executor = await asyncio.to_thread(_make_executor, self.config)
            try:
                await self._init_workers()
            except BaseException:
                await asyncio.to_thread(self.executor.shutdown)
                raise
            self._started = True
            logger.info("engine ready in %.2fs: %d KV blocks of %d tokens", time.perf_counter() - started,
                        self.num_blocks, self.config.cache.block_size)  # fmt: skip

    async def _init_workers(self) -> None:
        assert self.executor is not None
        rpc = self.executor.collective_rpc
        cfg = self.config
        await rpc("init_device")
        await rpc("load_model")
        # After load_model, not beside it: transformers' lazy imports race when two threads import at once.
        tokenizer_task = asyncio.create_task(asyncio.to_thread(_load_tokenizer, cfg.model.tokenizer or cfg.model.path))
        self.model_info = await rpc("get_model_info", unique_reply_rank=0)
        block_bytes = await rpc("get_cache_block_size_bytes", unique_reply_rank=0)
        available = min(await rpc("determine_available_memory"))
        self.num_blocks = cfg.cache.num_blocks or available // block_bytes
        if self.num_blocks < 2:  # block 0 is the null block, so one block serves nobody
            raise InvalidRequestError(
                f"no memory left for the KV cache ({available} bytes free, one block needs {block_bytes}); "
                "raise cache.kv_cache_memory_bytes / cache.memory_utilization or use a smaller model"
            )
        await rpc("initialize_from_config", (KVCacheConfig(self.num_blocks, cfg.cache.block_size),))
        await rpc("compile_or_warm_up_model")
        self.tokenizer = await tokenizer_task
        sched = cfg.scheduler
        scheduler = Scheduler(
            num_blocks=self.num_blocks,
            block_size=cfg.cache.block_size,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=self.model_info["max_model_len"],
            eos_token_ids=self.model_info["eos_token_ids"],
            enable_chunked_prefill=sched.enable_chunked_prefill,
        )
        self.core = EngineCore(scheduler, self.executor, self.tokenizer,
                               async_scheduling=sched.async_scheduling)  # fmt: skip
        self.core.start()

    async def shutdown(self) -> None:
        """Ends every stream, stops the loop task and the worker. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self.core is not None:
            await self.core.stop()
        if self.executor is not None:
            await asyncio.to_thread(self.executor.shutdown)

    # ---- requests ----------------------------------------------------------------------------------
    def _require_core(self) -> EngineCore:
        if self._closed:
            raise EngineDeadError("engine was shut down; create a new one")
        if self.core is None:
            raise EngineNotStartedError("call `await engine.start()` or use `async with AsyncEngine(...)` first")
        if self.core.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.core.dead}") from self.core.dead
        return self.core

    def _make_request(self, prompt: Prompt, params: SamplingParams, request_id: str) -> Request:
        if isinstance(prompt, str):
            token_ids = self.tokenizer(prompt).input_ids if prompt else []
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise InvalidRequestError(f"request {request_id!r}: the prompt is empty")
        vocab = self.model_info["vocab_size"]
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"request {request_id!r}: prompt token id {bad!r} is outside the vocabulary [0, {vocab})"
            )
        total = len(token_ids) + params.max_tokens
        max_len = self.model_info["max_model_len"]
        if total > max_len:
            raise RequestTooLargeError(
                f"request {request_id!r}: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds max_model_len={max_len}; shorten the prompt or lower max_tokens"
            )
        capacity = (self.num_blocks - 1) * self.config.cache.block_size  # minus the null block
        if total > capacity:
            raise RequestTooLargeError(
                f"request {request_id!r}: needs {total} tokens of KV cache but the whole cache holds {capacity}; "
                "lower max_tokens or give the cache more memory"
            )
        return Request(request_id, token_ids, params)

    async def generate(
        self, prompt: Prompt, params: SamplingParams | dict[str, Any] | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams outputs of one request until it finishes.

        Raises ``InvalidRequestError`` (a ``ValueError``) for a bad prompt or params before anything
        is queued; other requests are unaffected.
        """
        core = self._require_core()
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in core.collectors:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        collector = core.add_request(self._make_request(prompt, params, request_id))
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # consumer cancelled or stopped early: free the request's blocks now
                core.abort(request_id, notify=False)

    async def abort(self, request_id: str) -> bool:
        """Ends a request with finish_reason "abort"; True if it was in flight."""
        return self._require_core().abort(request_id)

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Runs a worker method (or a callable taking the worker) on every rank, ordered with the steps."""
        self._require_core()
        assert self.executor is not None
        return await self.executor.collective_rpc(method, args, kwargs, timeout, unique_reply_rank)

    async def check_health(self, timeout: float = 30.0) -> None:
        """Raises EngineDeadError if the engine died, or the worker's error if a worker is unhealthy."""
        self._require_core()
        await self.collective_rpc("check_health", timeout=timeout)

    async def start_profile(self) -> None:
        """Starts the torch profiler on every worker (needs ``profiler.dir``)."""
        await self.collective_rpc("profile", (True,))

    async def stop_profile(self) -> list[str | None]:
        """Stops the profiler; traces are written under ``profiler.dir``. Returns that dir per rank."""
        return await self.collective_rpc("profile", (False,))

    def stats(self) -> dict[str, Any]:
        """Snapshot of the engine's state, cheap enough to poll."""
        core = self.core
        if core is None:
            return {"started": False}
        scheduler = core.scheduler
        return {
            "started": True,
            "dead": core.dead is not None,
            "kv_blocks_total": scheduler.kv.num_blocks,
            "kv_blocks_free": scheduler.kv.num_free_blocks,
            "block_size": scheduler.kv.block_size,
            "requests_running": scheduler.num_running,
            "requests_waiting": scheduler.num_waiting,
            "num_preemptions": scheduler.num_preemptions,
            "num_steps": core.num_steps,
            "num_generated_tokens": core.num_generated_tokens,
            "worker_seconds": core.worker_seconds,
            "weights_version": core.weights_version,
            "sleeping": sorted(self._asleep),
            "weights_valid": self.weights_valid,
            "max_model_len": self.model_info.get("max_model_len"),
        }


def _with_model_path(config: EngineConfig) -> EngineConfig:
    """Fills in the embedded demo model when no checkpoint is configured (builds it once, cached)."""
    if config.model.path is not None:
        return config
    from aioengine.testing import default_model_dir

    model = config.model.model_copy(update={"path": str(default_model_dir())})
    return config.model_copy(update={"model": model})


def _make_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend != "thread":
        raise InvalidRequestError(f"parallel.distributed_executor_backend={backend!r} is not implemented yet; use 'thread'")
    from aioengine.executor.thread import ThreadExecutor

    return ThreadExecutor(config)


def _load_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
