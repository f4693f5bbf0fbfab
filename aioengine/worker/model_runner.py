"""ModelRunner: turns a SchedulerOutput into tensors (``step_inputs``), runs the forward, samples."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from aioengine.int_tensors import int64_tensor
from aioengine.messages import (
    KVCacheConfig,
    LogprobRows,
    ModelInfo,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from aioengine.model import cpu_kernels
from aioengine.model.hf_config import CheckpointConfig, load_hf_config
from aioengine.model.layers import use_cpu_kernels
from aioengine.model.linear import cpu_prepack_supported
from aioengine.model.llama import LlamaForCausalLM, tp_heads
from aioengine.model.loader import load_model, resolve_dtype, resolve_max_model_len
from aioengine.model.packing import drop_packed_weights, release_plain_weights, set_weight_prepack
from aioengine.model.parallel import SINGLE, TensorParallel
from aioengine.sampling.sampler import Sampler, SamplingMetadata
from aioengine.worker.cache_engine import CacheEngine
from aioengine.worker.graphs import PaddedDecodeRunner
from aioengine.worker.logprobs import asks_logprobs, known_token_logprobs, sampled_logprobs
from aioengine.worker.runner_cache import RunnerCache
from aioengine.worker.step_inputs import (
    DecodeBatch,
    DecodeWindow,
    StepInputs,
    fill_placeholders,
    padded_decode_inputs,
    prepare_inputs,
)
from aioengine.worker.step_sampling import RawArgmaxRows, sampling_metadata, window_stop_ids
from aioengine.worker.step_window import window_output

logger = logging.getLogger(__name__)


class ModelRunner(RunnerCache):
    """Holds the model and the KV cache of one worker (``RunnerCache``) and runs steps on them."""

    def __init__(self, config: Any, device: torch.device, tp: TensorParallel = SINGLE) -> None:
        self.config = config
        self.device = device
        self.tp = tp
        """This rank's tensor-parallel group: the model is its shard, rank 0 samples for the group."""
        self.kv_heads = 0
        """KV heads this rank's cache holds (the model's, or its share under tensor parallelism)."""
        self.bytes_loaded = 0
        """Bytes of checkpoint tensor data the last ``load_model`` read (this rank's slices only)."""
        self.model: LlamaForCausalLM | None = None
        self.hf_config: CheckpointConfig | None = None
        self.dtype: torch.dtype = torch.float32
        self.max_model_len = 0
        self.eos_token_ids: list[int] = []
        self.cache_engine: CacheEngine | None = None
        self.block_size = config.cache.block_size
        self.sampler = Sampler()
        self.decode_runner: PaddedDecodeRunner | None = None
        self.kv_cache_config: KVCacheConfig | None = None
        self.info: ModelInfo | None = None
        self._pending: _Pending | None = None
        self._last_sampled: dict[str, int] = {}
        """Tokens the last sampling step chose, by request: what ``PLACEHOLDER_TOKEN_ID`` stands for."""
        self._raw_argmax_rows = RawArgmaxRows()
        self._window = DecodeWindow()
        self.decode_kernel: Callable[..., None] | None = None
        """The C++ paged decode attention where it applies (``device.cpu_kernels``, CPU, float32)."""
        self.prefill_kernel: Callable[..., None] | None = None
        """The C++ prefill attention where it applies: as ``decode_kernel``, in AVX-512 and AVX2 builds, head size a
        multiple of 16."""

    # ---- set-up ------------------------------------------------------------------------------------
    def load_model(self, path: str) -> None:
        self.hf_config = cfg = load_hf_config(path)
        self.dtype = resolve_dtype(self.config.model.dtype, cfg, self.device)
        self.max_model_len = resolve_max_model_len(cfg, self.config.model.max_model_len)
        eos = cfg.eos_token_id
        self.eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        start = time.perf_counter()
        self.model, self.bytes_loaded = load_model(
            path,
            cfg,
            self.dtype,
            self.device,
            self.max_model_len,
            strict=self.config.load.strict,
            tp=self.tp,
        )
        self.kv_heads = tp_heads(cfg, self.tp)[1]
        self.info = ModelInfo(
            model_path=str(path),
            architecture=cfg.architectures[0],
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_size=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len,
            dtype=str(self.dtype).removeprefix("torch."),
            eos_token_ids=tuple(self.eos_token_ids),
        )
        if (
            self.config.device.cpu_kernels
            and self.device.type == "cpu"
            and self.dtype == torch.float32
            and self.cache_dtype() == torch.float32
        ):
            kernels = cpu_kernels.load()
            if kernels is not None:
                self.decode_kernel = kernels.paged_decode_attention
                if cfg.head_dim % 16 == 0:
                    self.prefill_kernel = getattr(kernels, "paged_prefill_attention", None)
                self.sampler = Sampler(argmax=kernels.argmax_rows)
                use_cpu_kernels(self.model, kernels)
                self.model.kernels = kernels  # weight writes copy the plain weights with them
                # greedy_tokens reads the lm_head on one rank only
                self.model.lm_head.set_greedy_screen(self.config.device.cpu_greedy_screen and self.model.tp.size == 1)
        release_plain_weights(self.model, not self.config.device.cpu_keep_plain_weights)
        self.prepack_weights()  # after the kernels: with them a copy may be read by their GEMM
        logger.info("loaded %s (%s) in %.2fs", path, self.dtype, time.perf_counter() - start)

    def prepack_weights(self) -> int:
        """(Re)builds the oneDNN copies of the linear weights where they are on (``device.cpu_weight_prepack``,
        CPU, float32), and the lm_head's greedy screen where greedy steps read it; returns the copies' bytes.
        Called after the weights change (never on discarded ones: the worker asks its sleep backend first); see
        ``linear.Linear``."""
        if self.model is None:
            return 0
        on = self.config.device.cpu_weight_prepack and cpu_prepack_supported(self.device, self.dtype)
        return set_weight_prepack(self.model, self.config.scheduler.max_num_seqs if on else None)

    def drop_packed_weights(self, keep_values: bool = True) -> None:
        """Frees the oneDNN weight copies (before sleep); the next ``prepack_weights`` or forward rebuilds them.
        A copy that was a weight's one store gives its values back to the plain weight first, unless the
        weights are being discarded (``keep_values=False``)."""
        if self.model is not None:
            drop_packed_weights(self.model, keep_values)

    def shutdown(self) -> None:
        """Drops graphs, KV cache and model, in that order (the graphs point into both). Idempotent."""
        self.release_kv_cache()
        self._pending = None
        self._last_sampled = {}
        self.model = None

    @torch.inference_mode()
    def profile_run(self, num_tokens: int | None = None) -> None:
        """A forward of one prefill of ``num_tokens`` (None: the largest step the scheduler can send), on a
        scratch cache just big enough."""
        largest = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        num_tokens = largest if num_tokens is None else min(num_tokens, largest)
        info = self.model_info()
        blocks = -(-num_tokens // self.block_size)
        scratch = CacheEngine(
            info.num_layers, self.kv_heads, info.head_size, self.block_size, blocks, self.cache_dtype(), self.device
        )
        req = ScheduledRequest("profile", [0] * num_tokens, 0, list(range(blocks)), sampling=None)
        inputs = self._prepare_inputs(SchedulerOutput(-1, [req]))
        assert self.model is not None
        self.model(
            inputs.input_ids,
            inputs.positions,
            scratch.device_cache,
            inputs.meta,
            torch.tensor([num_tokens - 1], device=self.device),
        )
        del scratch

    # ---- one step ----------------------------------------------------------------------------------
    def _prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        return prepare_inputs(
            sched, self.block_size, self.device, decode_kernel=self.decode_kernel, prefill_kernel=self.prefill_kernel
        )

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Runs the forward. Returns None when rows are left to sample: ``sample_tokens`` does that,
        so a worker extension can act between the forward and sampling (as in the seeds)."""
        if self.model is None or self.cache_engine is None:
            raise RuntimeError("refusing to run a forward: the model or KV cache is not allocated (asleep?)")
        start = time.perf_counter()
        if sched.is_empty:
            return ModelRunnerOutput(sched.step_id, [], [])
        batch = self._window.next_batch(sched, self.block_size)
        if batch is None:
            sched = fill_placeholders(sched, self._last_sampled)
        reqs = sched.requests
        # One rank: the lm_head waits for sample_tokens, which can pick greedy tokens without the logits.
        # Under tensor parallelism every rank computes them now (gathered across the ranks).
        lazy = self.tp.size == 1
        pending = _Pending(sched.step_id, [], start)
        if batch is not None or self._fits_decode_runner(reqs):
            runner = self.decode_runner
            assert runner is not None
            lazy = lazy and not runner.use_graphs  # a captured forward ends in the logits
            if batch is None:
                batch = runner.batch(reqs)
                # A window's next step moves this one's rows on, where no row groups are needed.
                if sched.num_steps > 1 and (self.decode_kernel is not None or runner.use_graphs):
                    self._window.start(sched, batch)
            pending.reqs, rows = self._run_padded_decode(reqs, batch, lazy)
        else:
            inputs = self._prepare_inputs(sched)
            pending.reqs, lazy = inputs.sample_reqs, lazy and not inputs.prompt_reqs
            rows = (self.model.final_hidden if lazy else self.model)(
                inputs.input_ids, inputs.positions, self.cache_engine.device_cache, inputs.meta, inputs.logits_indices
            )
            if inputs.prompt_reqs:
                if self.tp.rank == 0:  # rank 0 answers for the group
                    pending.prompt_logprobs = known_token_logprobs(rows[len(pending.reqs) :], inputs.prompt_reqs)
                rows = rows[: len(pending.reqs)]
        if not pending.reqs:
            return ModelRunnerOutput(
                sched.step_id, [], [], time.perf_counter() - start, prompt_logprobs=pending.prompt_logprobs
            )
        if lazy:
            pending.hidden = rows
        else:
            pending.logits = rows
        self._pending = pending
        return None

    @torch.inference_mode()
    def execute_window(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """A decode window's steps in one call of the kernels (``model.greedy_window``), where every row takes its raw
        argmax and the model runs them so; None otherwise (``run_window`` runs them one by one). Leaves nothing to
        sample."""
        if self.model is None or self.cache_engine is None:
            raise RuntimeError("refusing to run a forward: the model or KV cache is not allocated (asleep?)")
        if self._pending is not None or self.decode_kernel is None:
            return None
        start = time.perf_counter()
        sched = fill_placeholders(sched, self._last_sampled)
        reqs = sched.requests
        # decode rows that all sample (all_take_it refuses a row without sampling) their raw argmax
        if not _one_token_rows(reqs) or not self._raw_argmax_rows.all_take_it(reqs):
            return None
        batch = padded_decode_inputs(reqs, self.device, self.decode_kernel, self.block_size)
        steps = int64_tensor([r.num_steps for r in reqs], self.device)
        caches = self.cache_engine.device_cache
        stops = window_stop_ids(reqs, self.eos_token_ids, self.device)
        tokens = self.model.greedy_window(
            batch.rows[0], batch.rows[1], batch.block_tables, steps, caches, self.block_size, stops
        )
        if tokens is None:
            return None
        # -1 past a row's last step: its steps, or the stop id it ended on
        rows = [(r.req_id, [t for t in row if t >= 0]) for r, row in zip(reqs, tokens.tolist(), strict=True)]
        self._last_sampled = {req_id: row[-1] for req_id, row in rows}
        return window_output(sched.step_id, rows, time.perf_counter() - start)

    @property
    def pending_logits(self) -> torch.Tensor | None:
        """Logits [rows, vocab] that the next ``sample_tokens`` samples (inference tensors: modify them
        inside ``torch.inference_mode()``); None when nothing is pending. Computed here where the step left
        them for later: sampling then picks from these, changed or not."""
        return self._logits(self._pending) if self._pending is not None else None

    @torch.inference_mode()
    def _logits(self, pending: _Pending) -> torch.Tensor:
        if pending.logits is None:
            assert pending.hidden is not None and self.model is not None
            pending.logits, pending.hidden = self.model.compute_logits(pending.hidden), None
        return pending.logits

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        """Samples the rows the last ``execute_model`` left; one token per sampling request."""
        if self._pending is None:
            raise RuntimeError("sample_tokens() called without a preceding execute_model() that left rows to sample")
        pending, self._pending = self._pending, None
        step_id, reqs, start, prompt_logprobs = pending.step_id, pending.reqs, pending.start, pending.prompt_logprobs
        if self.tp.rank != 0:
            # Rank 0 samples for the group (ranks can never diverge, whatever the sampling); the others
            # take its tokens, which the next step's placeholders stand for.
            taken = self.tp.broadcast(torch.empty(len(reqs), dtype=torch.int64, device=self.tp.device))
            self._window.sampled(step_id, taken.to(self.device))
            chosen = taken.tolist()
            self._last_sampled = {r.req_id: token for r, token in zip(reqs, chosen, strict=True)}
            return ModelRunnerOutput(step_id, [r.req_id for r in reqs], chosen, time.perf_counter() - start)
        assert self.model is not None
        # Rows that all take their raw argmax and ask nothing more need no SamplingMetadata (a decode step's rows
        # paid ~70 us for it); the general path below makes the same choice of such rows, only slower.
        raw_argmax = pending.hidden is not None and self._raw_argmax_rows.all_take_it(reqs)
        meta = None if raw_argmax else self._metadata(pending)
        logprobs = None
        greedy = None
        if pending.hidden is not None and (meta is None or (meta.argmax_only and not asks_logprobs(reqs))):
            greedy = self.model.greedy_tokens(pending.hidden)  # the logits never written: [rows, vocab] spared
        if greedy is None:
            logits = self._logits(pending)
            sampled = self.sampler(logits, meta if meta is not None else self._metadata(pending))
            greedy = sampled.token_ids
            logprobs = sampled_logprobs(logits, sampled.processed_logits, sampled.token_ids, reqs)
        if self.tp.size > 1:
            self.tp.broadcast(greedy.to(self.tp.device, torch.int64))
        self._window.sampled(step_id, greedy.to(self.device, torch.int64))
        tokens = greedy.tolist()
        self._last_sampled = {r.req_id: token for r, token in zip(reqs, tokens, strict=True)}
        return ModelRunnerOutput(
            step_id,
            [r.req_id for r in reqs],
            tokens,
            time.perf_counter() - start,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _metadata(self, pending: _Pending) -> SamplingMetadata:
        """The sampling of ``pending``'s rows, packed."""
        assert self.model is not None
        return sampling_metadata(
            pending.reqs,
            self.device,
            vocab_size=self.model.lm_head.out_features if pending.logits is None else pending.logits.shape[-1],
            eos_token_ids=self.eos_token_ids,
            model_vocab_size=self.model_info().vocab_size,
        )

    def _fits_decode_runner(self, reqs: list[ScheduledRequest]) -> bool:
        runner = self.decode_runner
        return runner is not None and len(reqs) <= runner.max_batch_size and _one_token_rows(reqs)

    def _run_padded_decode(
        self, reqs: list[ScheduledRequest], batch: DecodeBatch, lazy: bool
    ) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """The sampling requests and their rows (``batch``, made of ``reqs``): the final norm's output where ``lazy``
        (and the batch runs eager), else logits."""
        assert self.decode_runner is not None
        run = self.decode_runner.run_hidden if lazy else self.decode_runner.run
        out = run(batch)
        rows = [i for i, r in enumerate(reqs) if r.sample]
        if len(rows) < len(reqs):  # a one-token prefill chunk that does not end its prompt
            out = out[rows]
        return [reqs[i] for i in rows], out


def _one_token_rows(reqs: list[ScheduledRequest]) -> bool:
    """Whether every row computes one token and asks no prompt logprobs: a decode batch's rows."""
    return all(len(r.token_ids) == 1 and r.prompt_logprobs is None for r in reqs)


@dataclass(slots=True)
class _Pending:
    """What ``execute_model`` left for ``sample_tokens``: the rows to sample as logits, or as the final norm's
    output (``hidden``) where the lm_head can wait (``ModelRunner._logits`` computes them on demand)."""

    step_id: int
    reqs: list[ScheduledRequest]
    start: float
    prompt_logprobs: dict[str, LogprobRows] | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
