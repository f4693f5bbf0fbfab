"""AsyncEngine: the public asyncio API. Works on any asyncio loop (uvloop in the CLI)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aioengine import gc_heap
from aioengine.config import EngineConfig
from aioengine.engine import intake
from aioengine.engine.control import EngineControl
from aioengine.engine.control_api import ControlAPI
from aioengine.engine.core import EngineCore
from aioengine.engine.intake import ChatMessages, Prompt
from aioengine.engine.outputs import RequestOutput, RequestStream, ScoreOutput
from aioengine.engine.stats import EngineStats, engine_stats
from aioengine.errors import (
    ConfigurationError,
    EngineDeadError,
    EngineNotStartedError,
    EngineStateError,
    InvalidRequestError,
    ScoreAbortedError,
)
from aioengine.executor.base import Executor
from aioengine.messages import KVCacheConfig, ModelInfo
from aioengine.sampling.params import SamplingParams
from aioengine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "ChatMessages", "EngineStats", "Prompt"]


class AsyncEngine(ControlAPI):
    """Continuous-batching generation inside your own event loop.

    ``async with AsyncEngine(config) as engine:`` starts the worker (model load, KV cache,
    warm-up) and shuts it down on exit. Every ``generate()`` stream is independent; cancelling
    the task that consumes one aborts that request and frees its KV blocks.

    Here: the lifecycle and the requests. The control calls (worker RPCs, health, profiling, sleep /
    wake, weight updates, pause / resume, the prefix cache) come from ``ControlAPI``.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        if config is not None and overrides:
            raise TypeError("pass either an EngineConfig or keyword sections, not both")
        self.config = config if config is not None else EngineConfig(**overrides)
        self.executor: Executor | None = None
        self.core: EngineCore | None = None
        self._control: EngineControl | None = None
        self.tokenizer: Any = None
        self._max_token_bytes = 1
        """UTF-8 bytes of the tokenizer's longest token: a text of N bytes is at least N / this tokens."""
        self.model_info: ModelInfo | None = None
        self._started = False
        self._closed = False
        self._start_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the engine was started in: its step loop and every stream live there."""
        self._holds_gc_freeze = False
        """This engine holds the process's freeze of its start-up heap (``aioengine.gc_heap``)."""

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Builds the executor and runs the worker lifecycle of the seeds through collective_rpc."""
        async with self._start_lock:
            if self._closed:
                raise EngineDeadError("engine was shut down; create a new one")
            if self._started:
                return
            self._loop = asyncio.get_running_loop()
            started = time.perf_counter()
            self.executor = await asyncio.to_thread(_make_executor, self.config)
            try:
                await self._init_workers(self.executor)
            except BaseException:
                await asyncio.to_thread(self.executor.shutdown)
                raise
            self._started = True
            if self.config.scheduler.freeze_gc:
                gc_heap.hold()  # last: what the start built (the model, the tokenizer) is frozen too
                self._holds_gc_freeze = True
            logger.info(
                "engine ready in %.2fs: %d KV blocks of %d tokens",
                time.perf_counter() - started,
                self.core.scheduler.kv.num_usable_blocks if self.core else 0,
                self.config.cache.block_size,
            )

    async def _init_workers(self, executor: Executor) -> None:
        rpc = executor.collective_rpc
        cfg = self.config
        await rpc("init_device")
        await rpc("load_model")
        info: ModelInfo = await rpc("get_model_info", unique_reply_rank=0)
        # After load_model, not beside it: transformers' lazy imports race when two threads import at once.
        tokenizer_task = asyncio.create_task(
            asyncio.to_thread(intake.load_tokenizer, cfg.model.tokenizer or info.model_path, cfg.model.tokenizer_mode)
        )
        block_bytes = await rpc("get_cache_block_size_bytes", unique_reply_rank=0)
        available = min(await rpc("determine_available_memory"))
        num_cache_blocks = cfg.cache.num_blocks or available // block_bytes
        if num_cache_blocks < 2:  # block 0 is the null block, so one block serves nobody
            raise ConfigurationError(
                f"no memory left for the KV cache ({available} bytes free, one block needs {block_bytes}); "
                "raise cache.kv_cache_memory_bytes / cache.memory_utilization or use a smaller model"
            )
        num_host_blocks = cfg.cache.swap_space_bytes // block_bytes if cfg.scheduler.preemption_mode == "swap" else 0
        await rpc("initialize_from_config", (KVCacheConfig(num_cache_blocks, cfg.cache.block_size, num_host_blocks),))
        await rpc("compile_or_warm_up_model")
        self.tokenizer, self._max_token_bytes = await tokenizer_task
        self.model_info = info
        sched = cfg.scheduler
        scheduler = Scheduler(
            num_cache_blocks=num_cache_blocks,
            block_size=cfg.cache.block_size,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=info.max_model_len,
            eos_token_ids=info.eos_token_ids,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            enable_prefix_caching=cfg.cache.enable_prefix_caching,
            preemption_mode=sched.preemption_mode,
            num_host_blocks=num_host_blocks,
            decode_steps=sched.decode_steps,
            decode_window_s=sched.decode_window_s,
        )
        self.core = EngineCore(scheduler, executor, self.tokenizer, async_scheduling=sched.async_scheduling)
        self._control = EngineControl(self.core, executor)
        self.core.start()

    async def shutdown(self) -> None:
        """Ends every stream, stops the loop task and the worker. Safe to call more than once, and while
        ``start()`` runs (it waits for the start to end, then stops what it built)."""
        if self._closed:
            return
        self._closed = True
        async with self._start_lock:
            try:
                if self.core is not None:
                    await self.core.stop()
                if self.executor is not None:
                    await asyncio.to_thread(self.executor.shutdown)
            finally:
                if self._holds_gc_freeze:
                    self._holds_gc_freeze = False
                    gc_heap.release()

    # ---- requests ----------------------------------------------------------------------------------
    def _require_core(self) -> EngineCore:
        if self._closed:
            raise EngineDeadError("engine was shut down; create a new one")
        if self.core is None:
            raise EngineNotStartedError("call `await engine.start()` or use `async with AsyncEngine(...)` first")
        if self.core.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.core.dead}") from self.core.dead
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is not self._loop:
            raise EngineStateError(
                "this engine was started in another event loop; an AsyncEngine serves only the loop it was "
                "started in (use one engine per loop, or the sync Engine, which runs its own loop)"
            )
        return self.core

    def _require_control(self) -> EngineControl:
        self._require_core()
        assert self._control is not None
        return self._control

    def chat_prompt_ids(self, messages: ChatMessages) -> list[int]:
        """The prompt token ids of a conversation: the tokenizer's chat template applied exactly as
        ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` does, so
        the model answers as the assistant. Raises ``InvalidRequestError`` for malformed messages or a
        tokenizer without a chat template."""
        self._require_core()
        return intake.apply_chat_template(self.tokenizer, messages)

    async def _prompt_ids(self, prompt: Prompt, request_id: str) -> list[int]:
        assert self.model_info is not None
        return await intake.prompt_ids(
            self.tokenizer, prompt, request_id, self._max_token_bytes, self.model_info.max_model_len
        )

    def _check_params(self, params: SamplingParams | dict[str, Any] | None, request_id: str) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        assert self.model_info is not None
        return intake.check_params(
            params,
            request_id,
            self.model_info,
            self.config.scheduler.max_num_seqs,
            self.config.model.max_logprobs,
            self.tokenizer,
        )

    async def generate(
        self,
        prompt: Prompt | None = None,
        params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        *,
        messages: ChatMessages | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams outputs of one request until it finishes.

        Give either ``prompt`` (text or token ids) or ``messages``, a conversation
        (``[{"role": "user", "content": "..."}]``) that the tokenizer's chat template turns into the
        prompt, as ``chat_prompt_ids`` does. Generation stops at the model's EOS (its chat end-of-turn
        token for instruct models) unless ``params.ignore_eos``.

        The prompt's leading full blocks whose KV an earlier request computed are reused (prefix caching,
        ``cache.enable_prefix_caching``); requests with different ``cache_salt`` never share it (tenants
        who must not learn from each other's timing).

        Raises ``InvalidRequestError`` (a ``ValueError``) for a bad prompt, messages or params before
        anything is queued; other requests are unaffected. ``submit`` is the same in two halves.
        """
        stream = await self.submit(prompt, params, request_id, messages=messages, cache_salt=cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()  # consumer cancelled or stopped early: free the request's blocks now

    async def submit(
        self,
        prompt: Prompt | None = None,
        params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        *,
        messages: ChatMessages | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Checks and queues one request now and returns its stream of outputs: what a server needs to
        refuse a bad request before it answers anything. Takes what ``generate`` takes and raises what it
        raises. Iterate the stream to its end or close it: closing it early aborts the request."""
        self._require_core()
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("pass exactly one of prompt and messages")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        params = self._check_params(params, request_id)
        token_ids = await self.tokenize(prompt, messages=messages, request_id=request_id)
        core = self._require_core()  # again: the engine may have stopped while a long prompt was tokenized
        assert self.model_info is not None
        intake.check_sequence(token_ids, params.max_tokens, request_id, self.model_info, core.scheduler)
        collector = core.add_request(intake.generation_request(token_ids, params, request_id, cache_salt))
        return RequestStream(request_id, collector, lambda: core.release_stream(request_id, collector))

    async def tokenize(
        self, prompt: Prompt | None = None, *, messages: ChatMessages | None = None, request_id: str | None = None
    ) -> list[int]:
        """The prompt token ids ``generate`` runs for ``prompt`` (a text tokenized with the tokenizer's special
        tokens; token ids as given, checked against the vocabulary only when submitted) or for ``messages``
        (the chat template). Long texts are tokenized off the event loop. Raises ``InvalidRequestError`` for
        what ``generate`` would refuse before tokenizing (malformed messages, a text far too long)."""
        self._require_core()
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("pass exactly one of prompt and messages")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if messages is not None:
            return await intake.chat_ids(self.tokenizer, messages, request_id)
        assert prompt is not None
        return await self._prompt_ids(prompt, request_id)

    async def score(
        self,
        prompt: Prompt,
        continuations: Sequence[Prompt],
        *,
        top_logprobs: int = 0,
        request_id: str | None = None,
    ) -> list[ScoreOutput]:
        """The logprob of every token of each continuation given the prompt and the tokens before it, with
        no sampling: what a trainer asks for reference logprobs. The prompt is computed once and its KV
        blocks are shared by the continuations.

        Continuations are token ids, or texts tokenized on their own without special tokens (token ids are
        exact; a text tokenized next to the prompt may split differently). ``top_logprobs`` adds the most
        likely tokens at each position. Logprobs are log-softmax of the model's logits in float32.
        """
        core = self._require_core()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if isinstance(continuations, str) or not continuations:
            raise InvalidRequestError(f"request {request_id!r}: continuations must be a non-empty list")
        max_seqs = self.config.scheduler.max_num_seqs
        if len(continuations) > max_seqs:
            raise InvalidRequestError(
                f"request {request_id!r}: {len(continuations)} continuations are more than scheduler.max_num_seqs="
                f"{max_seqs}, the most sequences a step runs; score them in smaller groups"
            )
        max_logprobs = self.config.model.max_logprobs
        if not 0 <= top_logprobs <= max_logprobs:
            raise InvalidRequestError(
                f"request {request_id!r}: top_logprobs={top_logprobs} must be in [0, model.max_logprobs={max_logprobs}]"
            )
        prompt_ids = await self._prompt_ids(prompt, request_id)
        conts = [await intake.continuation_ids(self.tokenizer, c, request_id, i) for i, c in enumerate(continuations)]
        core = self._require_core()
        assert self.model_info is not None
        for continuation in conts:  # each non-empty: continuation_ids refuses an empty one
            intake.check_sequence(prompt_ids + continuation, 1, request_id, self.model_info, core.scheduler)
        if not prompt_ids:
            raise InvalidRequestError(f"request {request_id!r}: the prompt is empty")
        request = intake.score_request(prompt_ids, conts, top_logprobs, request_id)
        collector = core.add_request(request, kind="score", num_scored_from=len(prompt_ids))
        finished = False
        try:
            out = await collector.get()
            finished = True
        finally:
            if not finished:
                core.release_stream(request_id, collector)
        if any(o.finish_reason == "abort" for o in out.outputs):
            raise ScoreAbortedError(f"request {request_id!r} was aborted before every continuation token was rated")
        return [ScoreOutput.of(o, out.weights_version) for o in out.outputs]

    async def abort(self, request_id: str) -> bool:
        """Ends a request with finish_reason "abort"; True if it was in flight."""
        return self._require_core().abort(request_id)

    def abort_all(self) -> int:
        """Ends every request in flight or queued with finish_reason "abort" (a server shutting down); returns
        how many. New requests are still accepted."""
        return self._require_core().abort_all()

    def stats(self) -> EngineStats:
        """Snapshot of the engine's state, cheap enough to poll."""
        return engine_stats(self.core, self.model_info.max_model_len if self.model_info else None)


def _make_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from aioengine.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from aioengine.executor.ray import RayExecutor

        return RayExecutor(config)
    if backend != "thread":
        raise ConfigurationError(
            f"parallel.distributed_executor_backend={backend!r} is not built yet; use 'thread', 'mp' or 'ray'"
        )
    from aioengine.executor.thread import ThreadExecutor

    return ThreadExecutor(config)
