"""AsyncEngine: the public asyncio API. Works on any asyncio loop (uvloop in the CLI)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from aioengine.config import EngineConfig
from aioengine.engine.control import EngineControl, SleepMode, SleepReport, UpdateMode, WakeReport, WeightUpdateReport
from aioengine.engine.core import EngineCore
from aioengine.engine.outputs import RequestOutput
from aioengine.errors import (
    ConfigurationError,
    EngineDeadError,
    EngineNotStartedError,
    EngineStateError,
    InvalidRequestError,
    RequestTooLargeError,
    WeightsLostError,
)
from aioengine.executor.base import Executor
from aioengine.messages import KVCacheConfig, ModelInfo, SleepLevel, WorkerWeightsReport
from aioengine.sampling.params import SamplingParams
from aioengine.scheduler.request import Request
from aioengine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
ChatMessages = Sequence[Mapping[str, str]]
"""A conversation: ``[{"role": "system" | "user" | "assistant", "content": "..."}, ...]``."""

LONG_PROMPT_CHARS = 16_384
"""Text prompts longer than this are tokenized on a thread, so the event loop keeps serving meanwhile."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's state, cheap enough to poll."""

    started: bool
    dead: bool = False
    kv_blocks_total: int = 0
    """Blocks requests can hold (the cache's blocks minus the null block)."""
    kv_blocks_free: int = 0
    block_size: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_generated_tokens: int = 0
    worker_seconds: float = 0.0
    weights_version: int = 0
    requests_held: int = 0
    """Requests that arrived during a drain and wait for it to end."""
    draining: bool = False
    """A control call (sleep "wait", update_weights "drain") is finishing the requests in flight."""
    sleeping: tuple[str, ...] = ()
    weights_valid: bool = True
    max_model_len: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (for logs, metrics, HTTP)."""
        return asdict(self)


class AsyncEngine:
    """Continuous-batching generation inside your own event loop.

    ``async with AsyncEngine(config) as engine:`` starts the worker (model load, KV cache,
    warm-up) and shuts it down on exit. Every ``generate()`` stream is independent; cancelling
    the task that consumes one aborts that request and frees its KV blocks.
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
        tokenizer_task = asyncio.create_task(asyncio.to_thread(_load_tokenizer, cfg.model.tokenizer or info.model_path))
        block_bytes = await rpc("get_cache_block_size_bytes", unique_reply_rank=0)
        available = min(await rpc("determine_available_memory"))
        num_cache_blocks = cfg.cache.num_blocks or available // block_bytes
        if num_cache_blocks < 2:  # block 0 is the null block, so one block serves nobody
            raise ConfigurationError(
                f"no memory left for the KV cache ({available} bytes free, one block needs {block_bytes}); "
                "raise cache.kv_cache_memory_bytes / cache.memory_utilization or use a smaller model"
            )
        await rpc("initialize_from_config", (KVCacheConfig(num_cache_blocks, cfg.cache.block_size),))
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

    async def _prompt_ids(self, prompt: Prompt, request_id: str) -> list[int]:
        """Token ids of a prompt. A text that must be longer than ``max_model_len`` whatever it says is
        refused before it is tokenized; a long one is tokenized off the event loop."""
        if not isinstance(prompt, str):
            return list(prompt)
        if not prompt:
            return []
        assert self.model_info is not None
        at_least = len(prompt.encode()) // self._max_token_bytes  # no token covers more bytes than this
        if at_least > self.model_info.max_model_len:
            raise RequestTooLargeError(
                f"request {request_id!r}: the prompt ({len(prompt)} characters) is at least {at_least} tokens, "
                f"more than max_model_len={self.model_info.max_model_len}; shorten it"
            )
        if len(prompt) <= LONG_PROMPT_CHARS:
            ids: list[int] = self.tokenizer(prompt).input_ids
        else:
            ids = (await asyncio.to_thread(self.tokenizer, prompt)).input_ids
        return ids

    def chat_prompt_ids(self, messages: ChatMessages) -> list[int]:
        """The prompt token ids of a conversation: the tokenizer's chat template applied exactly as
        ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` does, so
        the model answers as the assistant. Raises ``InvalidRequestError`` for malformed messages or a
        tokenizer without a chat template."""
        self._require_core()
        return _apply_chat_template(self.tokenizer, messages)

    def _make_request(self, core: EngineCore, token_ids: list[int], params: SamplingParams, request_id: str) -> Request:
        info = self.model_info
        assert info is not None
        if not token_ids:
            raise InvalidRequestError(f"request {request_id!r}: the prompt is empty")
        vocab = info.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"request {request_id!r}: prompt token id {bad!r} is outside the vocabulary [0, {vocab})"
            )
        total = len(token_ids) + params.max_tokens
        if total > info.max_model_len:
            raise RequestTooLargeError(
                f"request {request_id!r}: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds max_model_len={info.max_model_len}; shorten the prompt or lower max_tokens"
            )
        scheduler = core.scheduler
        if not scheduler.enable_chunked_prefill and len(token_ids) > scheduler.max_num_batched_tokens:
            raise RequestTooLargeError(
                f"request {request_id!r}: the prompt ({len(token_ids)} tokens) can never be scheduled: with chunked "
                f"prefill off a prompt must fit in one step, scheduler.max_num_batched_tokens="
                f"{scheduler.max_num_batched_tokens}; shorten it, raise that limit or enable chunked prefill"
            )
        capacity = scheduler.kv.capacity_tokens
        if total > capacity:
            raise RequestTooLargeError(
                f"request {request_id!r}: needs {total} tokens of KV cache but the whole cache holds {capacity}; "
                "lower max_tokens or give the cache more memory"
            )
        return Request(request_id, token_ids, params)

    async def generate(
        self,
        prompt: Prompt | None = None,
        params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        *,
        messages: ChatMessages | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams outputs of one request until it finishes.

        Give either ``prompt`` (text or token ids) or ``messages``, a conversation
        (``[{"role": "user", "content": "..."}]``) that the tokenizer's chat template turns into the
        prompt, as ``chat_prompt_ids`` does. Generation stops at the model's EOS (its chat end-of-turn
        token for instruct models) unless ``params.ignore_eos``.

        Raises ``InvalidRequestError`` (a ``ValueError``) for a bad prompt, messages or params before
        anything is queued; other requests are unaffected.
        """
        core = self._require_core()
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("pass exactly one of prompt and messages")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if messages is not None:
            if sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, Mapping)) <= LONG_PROMPT_CHARS:
                token_ids = _apply_chat_template(self.tokenizer, messages, request_id)
            else:
                token_ids = await asyncio.to_thread(_apply_chat_template, self.tokenizer, messages, request_id)
        else:
            assert prompt is not None
            token_ids = await self._prompt_ids(prompt, request_id)
        core = self._require_core()  # again: the engine may have stopped while a long prompt was tokenized
        if request_id in core.collectors:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        collector = core.add_request(self._make_request(core, token_ids, params, request_id))
        finished = False
        try:
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # consumer cancelled or stopped early: free the request's blocks now
                core.release_stream(request_id, collector)

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
        """Runs a worker method (or a callable taking the worker) on every rank, ordered with the steps.

        A method that writes weights through the worker's one write path (``Worker.write_weights``, as
        the weight-sync plugin does) returns a ``WorkerWeightsReport``; the engine takes the new
        ``weights_version`` from it, and serves again once a full write replaced discarded weights.
        """
        core = self._require_core()
        assert self.executor is not None
        try:
            results = await self.executor.collective_rpc(method, args, kwargs, timeout, unique_reply_rank)
        except WeightsLostError:
            core.weights_lost()
            raise
        replies = results if unique_reply_rank is None else [results]
        reports = [r for r in replies if isinstance(r, WorkerWeightsReport)]
        if reports:
            core.weights_written(WorkerWeightsReport.merge(reports))
        return results

    async def check_health(self, timeout: float = 30.0) -> None:
        """Raises EngineDeadError if the engine died, EngineStateError while a timed-out RPC still holds a
        worker (model steps wait behind it), or the worker's error if a worker is unhealthy."""
        self._require_core()
        assert self.executor is not None
        overdue = self.executor.overdue_calls()
        if overdue:
            raise EngineStateError(f"a worker is held by {', '.join(overdue)}; model steps wait until it returns")
        await self.collective_rpc("check_health", timeout=timeout)

    async def start_profile(self) -> None:
        """Starts the torch profiler on every worker (needs ``profiler.dir``)."""
        await self.collective_rpc("profile", (True,))

    async def stop_profile(self) -> list[str | None]:
        """Stops the profiler; traces are written under ``profiler.dir``. Returns that dir per rank."""
        result: list[str | None] = await self.collective_rpc("profile", (False,))
        return result

    # ---- sleep, wake, weights ------------------------------------------------------------------------
    async def sleep(self, level: SleepLevel = 1, mode: SleepMode = "wait") -> SleepReport:
        """Frees the engine's device memory so another tenant can use it.

        level 1 keeps a host copy of the weights; level 2 discards them (load them again with
        ``reload_weights`` or ``update_weights`` after ``wake_up``). ``mode`` says what happens to
        requests in flight: "wait" finishes them first, "abort" ends them (finish_reason "abort"),
        "keep" preempts them and they continue after wake, recomputing their KV. Requests submitted
        while asleep wait and run after wake. A caller that is cancelled or times out while the
        workers free their memory does not stop them: the sleep completes and is recorded.
        """
        return await self._require_control().sleep(level, mode)

    async def wake_up(self, tags: Iterable[str] | None = None) -> WakeReport:
        """Restores "weights" and/or "kv_cache" (default both). Scheduling resumes only once every
        tag is awake (and, after level 2, the weights were loaded again)."""
        return await self._require_control().wake_up(tags)

    async def is_sleeping(self) -> bool:
        """True until every tag is awake."""
        return self._require_core().memory.is_sleeping

    async def reload_weights(self, mode: UpdateMode = "pause") -> WeightUpdateReport:
        """Loads the checkpoint the engine started from into the model again, in place (e.g. after
        sleep level 2)."""
        self._require_core()
        assert self.model_info is not None
        return await self.update_weights(self.model_info.model_path, mode=mode)

    async def update_weights(
        self,
        source: Any,
        mode: UpdateMode = "pause",
        partial: bool = False,
        stage: bool = False,
        allow_non_finite: bool = False,
    ) -> WeightUpdateReport:
        """Swaps new weights into the live engine, all or nothing.

        ``source``: a safetensors file or directory, a ``{name: tensor}`` dict, or an iterable of
        ``(name, tensor)`` (checkpoint names; q/k/v and gate/up are fused for you). Every tensor's
        name, shape and dtype is checked before the first write; a bad source raises
        ``CheckpointError`` naming the tensor, changes nothing, and the engine keeps serving.
        ``partial=True`` allows updating only some tensors. ``mode`` for requests in flight:
        "pause" swaps between two steps (they go on with the new weights), "drain" finishes them on
        the old weights first, "abort" ends them, "recompute" drops their KV and recomputes it under
        the new weights. Requests sent meanwhile wait; none is dropped. ``stage=True`` reads and
        checks the whole source into host memory while the engine keeps serving, so the pause covers
        only the copy.

        Tensors held in memory must be readable as they are (not on the meta device, not DTensor
        shards, dense) and finite (``allow_non_finite=True`` writes NaN / Inf anyway). Files are
        streamed, so their data is checked as it is read: a file that breaks or a non-finite tensor
        after the first write raises ``WeightsLostError`` and the engine serves nothing until a full
        update or ``reload_weights`` succeeds (never a mix of old and new). ``stage=True`` checks
        everything before the first write.
        """
        return await self._require_control().update_weights(source, mode, partial, stage, allow_non_finite)

    @property
    def weights_version(self) -> int:
        """+1 per successful weight write; outputs carry the version they were computed with."""
        return self.core.weights_version if self.core is not None else 0

    @property
    def is_awake(self) -> bool:
        """Started, alive, and every tag awake (the weights may still need a reload after level 2)."""
        core = self.core
        return core is not None and core.dead is None and not core.memory.is_sleeping

    def stats(self) -> EngineStats:
        """Snapshot of the engine's state, cheap enough to poll."""
        core = self.core
        if core is None:
            return EngineStats(started=False)
        scheduler = core.scheduler
        return EngineStats(
            started=True,
            dead=core.dead is not None,
            kv_blocks_total=scheduler.kv.num_usable_blocks,
            kv_blocks_free=scheduler.kv.num_free_blocks,
            block_size=scheduler.kv.block_size,
            requests_running=scheduler.num_running,
            requests_waiting=scheduler.num_waiting,
            num_preemptions=scheduler.num_preemptions,
            num_steps=core.num_steps,
            num_generated_tokens=core.num_generated_tokens,
            worker_seconds=core.worker_seconds,
            weights_version=core.weights_version,
            requests_held=len(core.held),
            draining=core.draining,
            sleeping=tuple(sorted(core.memory.asleep)),
            weights_valid=core.memory.weights_valid,
            max_model_len=self.model_info.max_model_len if self.model_info else None,
        )


def _make_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend != "thread":
        raise ConfigurationError(
            f"parallel.distributed_executor_backend={backend!r} is not built yet; use 'thread' "
            "(with tensor_parallel_size=1)"
        )
    from aioengine.executor.thread import ThreadExecutor

    return ThreadExecutor(config)


def _apply_chat_template(tokenizer: Any, messages: ChatMessages, request_id: str | None = None) -> list[int]:
    """``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` as a list of ids
    (transformers 5 returns a BatchEncoding, 4.x a list), with malformed input refused by name."""
    where = f"request {request_id!r}: " if request_id is not None else ""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(f"{where}messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{where}messages[{i}] is a {type(message).__name__}, not a dict")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequestError(f"{where}messages[{i}] needs a string {key!r}, got {message.get(key)!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            f"{where}this model's tokenizer has no chat template, so it cannot take messages; pass a prompt instead"
        )
    try:
        encoded = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the template's own checks (e.g. roles that must alternate) raise what they like
        raise InvalidRequestError(f"{where}the chat template refused these messages: {exc}") from exc
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded  # BatchEncoding is a Mapping
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


def _load_tokenizer(path: str) -> tuple[Any, int]:
    """The checkpoint's tokenizer and the UTF-8 length of its longest token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    longest = max((len(token.encode()) for token in tokenizer.get_vocab()), default=1)
    return tokenizer, max(longest, 1)
