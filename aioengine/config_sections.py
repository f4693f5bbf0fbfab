"""The sections of ``EngineConfig``: one pydantic model per layer, with its defaults and checks.

Every section forbids unknown keys, so a typo in a TOML table, an environment
variable or a keyword argument is an error naming the field. How the sections
are gathered from their sources is ``aioengine.config``'s.

This is a bottom module: it imports nothing from aioengine and never torch.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "CacheConfig",
    "CompileConfig",
    "CpuPriority",
    "DType",
    "DeviceConfig",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "PreemptionMode",
    "ProfilerConfig",
    "SchedulerConfig",
    "SleepConfig",
    "TokenizerMode",
]

DType = Literal["auto", "float32", "float16", "bfloat16"]
TokenizerMode = Literal["auto", "hf"]
PreemptionMode = Literal["recompute", "swap"]
"""A request preempted when KV blocks run out: its blocks freed and computed again on resume, or copied
to the host pool and back."""
CpuPriority = Literal["idle", "normal"]
"""How work beside serving is scheduled on the host: "idle", only on cores nothing else wants (``SCHED_IDLE``,
Linux; where the OS has no such policy or refuses it, as "normal"); "normal", as any thread of the process."""

_DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
_DOTTED_NAME_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def _check_dotted_name(value: str) -> str:
    if not _DOTTED_NAME_RE.fullmatch(value):
        raise ValueError(f"expected an importable 'module.Qualname' such as 'mypkg.ext.MyExtension', got {value!r}")
    return value


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid")


def _path_to_str(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


class ModelConfig(_Section):
    """Which checkpoint to serve and how to load its weights."""

    _paths_as_str = field_validator("path", "tokenizer", mode="before")(_path_to_str)

    path: str | None = Field(
        None,
        description=(
            "HF checkpoint directory. None: the embedded default model (SmolLM2-135M-Instruct, fetched and "
            "converted once; the random-init demo model when it cannot be had)."
        ),
    )
    tokenizer: str | None = Field(None, description="Tokenizer directory. None uses the checkpoint directory (`path`).")
    tokenizer_mode: TokenizerMode = Field(
        "auto",
        description=(
            "'auto': aioengine's own tokenizer on the `tokenizers` library (no transformers import at start-up) when "
            "the directory has a tokenizer.json and nothing it does not reproduce, else transformers' AutoTokenizer; "
            "'hf': always AutoTokenizer."
        ),
    )
    dtype: DType = Field(
        "auto",
        description="Weight and activation dtype. 'auto' is float32 on CPU, the checkpoint's dtype on CUDA.",
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="Longest sequence (prompt + output) in tokens. None takes it from the checkpoint config.",
    )
    seed: int = Field(0, description="Seed of the random generators used for sampling.")
    max_logprobs: int = Field(
        20,
        ge=0,
        description="The most top logprobs a request may ask for (SamplingParams.logprobs / prompt_logprobs).",
    )


class CacheConfig(_Section):
    """The paged KV cache."""

    block_size: int = Field(16, description="Tokens per KV cache block: a power of two from 1 to 256.")
    num_blocks: int | None = Field(
        None, ge=1, description="Number of KV cache blocks (one of them is the null block). None: sized from memory."
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="Host memory for the KV cache on CPU, in bytes. None: a share of free memory.",
    )
    memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Fraction of device memory (0 < x <= 1) the engine may use on CUDA, KV cache included.",
    )
    cache_dtype: DType = Field("auto", description="KV cache dtype. 'auto' uses the model dtype.")
    swap_space_bytes: int = Field(
        1 << 30,
        ge=0,
        description="Host memory (pinned on CUDA) for KV blocks swapped out by preemption; used only with "
        "scheduler.preemption_mode = 'swap'.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the KV of full blocks that an earlier request computed for the same leading tokens "
        "(system prompts, chat history, the same prompt again); emptied on every weight write and sleep.",
    )

    @field_validator("block_size")
    @classmethod
    def _block_size_is_power_of_two(cls, value: int) -> int:
        if not (1 <= value <= 256 and value & (value - 1) == 0):
            raise ValueError(f"block_size must be a power of two from 1 to 256 (1, 2, 4, ..., 256), got {value}")
        return value


class SchedulerConfig(_Section):
    """How many sequences and tokens one engine step may batch, and how the step loop runs.

    Without chunked prefill a whole prompt must fit in ``max_num_batched_tokens``;
    the engine checks that against ``max_model_len`` once the model is known.
    """

    max_num_seqs: int = Field(64, ge=1, description="Most sequences running in one step.")
    max_num_batched_tokens: int = Field(512, ge=1, description="Most tokens (prefill + decode) computed in one step.")
    enable_chunked_prefill: bool = Field(
        True, description="Split long prompts over several steps so decodes keep running."
    )
    async_scheduling: bool = Field(
        True,
        description=(
            "Schedule step N+1 while step N runs, its new tokens standing in as placeholders the worker fills "
            "in, so the worker never waits for the event loop between steps. A request that ends on EOS or a "
            "stop token still runs one step more (its token is dropped); on a stop string, up to two."
        ),
    )
    decode_steps: int = Field(
        8,
        ge=1,
        description=(
            "Most decode steps the workers run back to back as one step (a decode window) while every running "
            "sequence decodes plain greedy (no logprobs, no stop strings, past min_tokens) and no waiting request "
            "has a free seat: the step loop's own cost per step is then paid once per window. 1: every step is one "
            "forward. A sequence that ends inside a window (EOS, a stop id) has its later tokens dropped."
        ),
    )
    decode_window_s: float = Field(
        0.02,
        ge=0,
        description=(
            "A decode window runs no more steps than fit in this many seconds at the speed of the last all-decode "
            "step: it bounds what windows add to a new request's first token (one that arrives with a seat takes "
            "back the window queued behind the running one) and to a stream's gaps. Models whose decode step takes "
            "longer than this never run windows (their step loop's cost is small beside it)."
        ),
    )
    preemption_mode: PreemptionMode = Field(
        "recompute",
        description=(
            "What happens to a request preempted when KV blocks run out: 'recompute' frees its blocks and "
            "computes them again when it resumes; 'swap' copies them to a host pool of cache.swap_space_bytes "
            "and back (recompute when the pool is full)."
        ),
    )
    freeze_gc: bool = Field(
        True,
        description=(
            "Once the engine has started, freeze every object then alive out of Python's garbage collector "
            "(gc.freeze) until the last engine of the process stops: a full collection of the start-up heap "
            "stops the event loop and the worker for 150-200 ms; after it, collections walk only what serving "
            "allocated. Worker processes freeze after their warm-up. Off: the process's collector is left as it "
            "is (an application that froze its own heap and wants it kept frozen after the engine stops)."
        ),
    )


class ParallelConfig(_Section):
    """How many workers run the model and where they live."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    tensor_parallel_size: int = Field(1, ge=1, description="Number of workers the model is sharded over.")
    distributed_executor_backend: Literal["thread", "mp", "ray"] = Field(
        "thread",
        description=(
            "Where workers run: a thread, subprocesses ('mp') or Ray actors. tensor_parallel_size > 1 needs "
            "'mp' or 'ray'."
        ),
    )
    step_timeout_s: float = Field(
        300.0,
        gt=0,
        description=(
            "mp / ray: a model step or collective still running after this many seconds means a worker rank "
            "hangs; the engine then reports dead and fails every request (as when a rank dies)."
        ),
    )
    ray_address: str | None = Field(
        None,
        description=(
            "ray: the cluster to connect to ('auto' for the one running on this machine, 'HOST:PORT', or "
            "'ray://HOST:PORT' for Ray Client). None uses Ray when this process already initialized it, else "
            "starts a private local Ray instance for the engine (stopped with it)."
        ),
    )
    worker_cls: str = Field(
        "auto",
        description="Worker class as 'module.Qualname'; 'auto' picks the CPU or CUDA worker for the device.",
    )
    worker_extension_cls: str | type | None = Field(
        None,
        description=(
            "Mixin added to the worker class, as 'module.Qualname' or (from Python only) the class itself. "
            "Its methods become callable through collective_rpc."
        ),
    )

    @field_validator("worker_cls")
    @classmethod
    def _worker_cls_is_dotted(cls, value: str) -> str:
        return value if value == "auto" else _check_dotted_name(value)

    @field_validator("worker_extension_cls")
    @classmethod
    def _worker_extension_cls_is_dotted(cls, value: str | type | None) -> str | type | None:
        return _check_dotted_name(value) if isinstance(value, str) else value


class DeviceConfig(_Section):
    """The device the model runs on."""

    device: str = Field("auto", description="'auto' (CUDA if available, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    num_threads: int | None = Field(
        None,
        ge=1,
        description=(
            "torch intra-op threads on CPU (per rank). None keeps torch's default, or with tensor_parallel_size "
            "> 1 gives each rank an equal share of the host's cores."
        ),
    )
    cpu_kernels: bool = Field(
        True,
        description=(
            "CPU, float32: use aioengine's C++ paged decode attention, built once on first use (needs a C++ "
            "compiler and ninja; about 30 s, then cached). Without them the torch path runs, with a warning."
        ),
    )
    cpu_weight_prepack: bool = Field(
        True,
        description=(
            "CPU, float32: run the linear layers from oneDNN-reordered copies of their weights (much faster "
            "small-batch GEMMs than MKL's sgemm). Where aioengine's kernels rewrite a copy in place, the copy is "
            "the weight's one store (see cpu_keep_plain_weights); else it is a second copy in memory."
        ),
    )
    cpu_greedy_screen: bool = Field(
        True,
        description=(
            "CPU, float32, AVX512-BF16 and AVX512-VNNI hosts: greedy steps find the lm_head's argmax from a copy "
            "of its weight in int8 and bfloat16, summing in float32 only the rows that copy cannot rule out: the "
            "same tokens, bit for bit, at about a third of the lm_head's cost, for at most half its weight's bytes "
            "again in memory (made by the first greedy step, freed by sleep; a weight swap or a wake makes it again "
            "within its own pause where greedy steps read it)."
        ),
    )
    cpu_keep_plain_weights: bool = Field(
        False,
        description=(
            "With cpu_weight_prepack: keep each linear layer's plain weight beside its reordered copy (twice the "
            "memory, and a weight swap writes both). Off, the plain parameters of those layers are meta "
            "placeholders: worker extensions read weights with aioengine.model.packing.dense_parameters(model)."
        ),
    )

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, value: str) -> str:
        if not _DEVICE_RE.fullmatch(value):
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N' (N a device index, e.g. 'cuda:0'), got {value!r}"
            )
        return value


class LoadConfig(_Section):
    """How checkpoint weights are read."""

    load_format: Literal["safetensors"] = Field(
        "safetensors",
        description="Weight file format. Only safetensors: pickle formats (.bin, .pt) can run code; refused.",
    )
    strict: bool = Field(True, description="Fail on checkpoint tensors the model does not use. False ignores them.")
    staging_priority: CpuPriority = Field(
        "idle",
        description=(
            "CPU priority of update_weights(stage=True)'s reading while the engine serves. 'idle': only on cores "
            "the steps leave free (Linux SCHED_IDLE), so serving keeps its pace and staging takes longer on a busy "
            "host; 'normal': as fast as it can, slowing the steps beside it where cores are few."
        ),
    )


class CompileConfig(_Section):
    """Decode-step capture: CUDA graphs on CUDA, the same padded-bucket path run eagerly on CPU."""

    enforce_eager: bool = Field(
        False, description="Run every step eagerly: no CUDA graphs, no padding of decode batches to buckets."
    )
    cuda_graph_sizes: list[int] | None = Field(
        None,
        description=(
            "Decode batch sizes to capture (batches are padded up to the next one). "
            "None: 1, 2, 4, 8, then multiples of 8 up to scheduler.max_num_seqs."
        ),
    )

    @field_validator("cuda_graph_sizes")
    @classmethod
    def _sizes_are_positive(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(size < 1 for size in value)):
            raise ValueError(f"cuda_graph_sizes must be a non-empty list of sizes >= 1, got {value}")
        return sorted(set(value)) if value is not None else None


class ProfilerConfig(_Section):
    """torch profiler traces, started and stopped with engine.start_profile() / stop_profile()."""

    dir: str | None = Field(
        None, description="Directory for torch profiler traces. None: profiling is off (profile() raises)."
    )
    _dir_as_str = field_validator("dir", mode="before")(_path_to_str)
    record_shapes: bool = Field(False, description="Record tensor shapes in the trace.")
    with_stack: bool = Field(False, description="Record Python stacks in the trace (slower).")


class SleepConfig(_Section):
    """How sleep() frees device memory."""

    backend: Literal["auto", "portable", "torch_memory_saver"] = Field(
        "auto",
        description=(
            "'portable' frees and reallocates storages (CUDA graphs are recaptured on wake); "
            "'torch_memory_saver' keeps virtual addresses on CUDA so graphs stay valid; "
            "'auto' picks torch_memory_saver on CUDA when installed, else portable."
        ),
    )
