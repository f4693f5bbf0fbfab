"""WorkerBase: the hardware-agnostic contract every worker keeps (seeds: worker_base.py).

The Executor drives these methods through ``collective_rpc``; it never sees which device a
worker runs on. Lifecycle: ``init_device -> load_model -> determine_available_memory ->
initialize_from_config -> compile_or_warm_up_model``, then ``execute_model`` every step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from aioengine.messages import (
    KVCacheConfig,
    ModelInfo,
    ModelRunnerOutput,
    SchedulerOutput,
    SleepLevel,
    WorkerSleepReport,
    WorkerWakeReport,
)


class WorkerBase(ABC):
    """One worker per device (per tensor-parallel rank)."""

    def __init__(
        self,
        config: Any,
        rank: int = 0,
        local_rank: int = 0,
        is_driver_worker: bool = True,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.is_driver_worker = is_driver_worker
        self.distributed_init_method = distributed_init_method
        """``tcp://127.0.0.1:PORT``: where the ranks of a tensor-parallel model meet (None: a single rank)."""
        # Cooperative: a worker extension mixed in after the worker class gets its own __init__ (no
        # arguments) called too, once config and rank are set.
        super().__init__()

    @abstractmethod
    def init_device(self) -> None:
        """Binds the worker to its device, records its free memory, seeds RNGs."""

    @abstractmethod
    def load_model(self) -> None:
        """Loads the weights onto the device."""

    @abstractmethod
    def get_model_info(self) -> ModelInfo:
        """Layer/head counts, vocab size, max length and EOS ids of the loaded model."""

    @abstractmethod
    def get_cache_block_size_bytes(self) -> int:
        """Bytes of one KV block across all layers."""

    @abstractmethod
    def determine_available_memory(self) -> int:
        """Bytes this worker can give to the KV cache (after a profiling forward on accelerators)."""

    @abstractmethod
    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocates the KV cache the engine decided on; the worker does not pick its size."""

    @abstractmethod
    def compile_or_warm_up_model(self) -> float:
        """Warms up (captures graphs on CUDA); returns the seconds it took."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Runs the cache operations of the step, then the forward.

        Returns None when tokens are left to sample; the executor then calls ``sample_tokens``.
        """

    def execute_window(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """A decode window (``num_steps`` > 1) in one go, where the worker can; None: the executor runs its steps
        one by one through ``execute_model`` and ``sample_tokens`` (``run_window``)."""
        return None

    @abstractmethod
    def sample_tokens(self) -> ModelRunnerOutput:
        """Samples the logits the last ``execute_model`` left (seeds: split so extensions can act between)."""

    @abstractmethod
    def profile(self, is_start: bool = True) -> str | None:
        """Starts / stops the torch profiler (``profiler.dir``); RuntimeError naming the option when unset."""

    @abstractmethod
    def sleep(self, level: SleepLevel = 1) -> WorkerSleepReport:
        """Frees device memory: level 1 keeps a host copy of the weights, level 2 discards them."""

    @abstractmethod
    def wake_up(self, tags: Iterable[str] | None = None) -> WorkerWakeReport:
        """Restores "weights" and/or "kv_cache" (default both)."""

    def check_health(self) -> None:  # noqa: B027 - an optional hook: a worker that can always serve keeps it
        """Raises if the worker cannot serve; returns None while it can."""

    @abstractmethod
    def shutdown(self) -> None:
        """Releases the model and the cache; safe to call more than once."""
