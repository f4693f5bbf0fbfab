"""Worker: one device, its model (via ModelRunner) and its KV cache (via CacheEngine)."""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

import torch

from aioengine.errors import AIOEngineError
from aioengine.messages import KVCacheConfig, ModelRunnerOutput, SchedulerOutput
from aioengine.worker.base import WorkerBase
from aioengine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Default KV budget on CPU when cache.kv_cache_memory_bytes is unset: a share of free host memory,
# capped so an engine in a larger application does not grab the whole machine.
CPU_KV_SHARE = 0.25
CPU_KV_CAP = 4 << 30


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise AIOEngineError(f"device.device={name!r} but CUDA is not available here; use 'cpu' or 'auto'")
    return torch.device(name)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the OS can give without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class Worker(WorkerBase):
    """The worker for CPU and CUDA devices; device-specific parts branch on ``self.device.type``."""

    def __init__(self, config: Any, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None, is_driver_worker: bool = True) -> None:  # fmt: skip
        super().__init__(config, rank, local_rank, distributed_init_method, is_driver_worker)
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        self.init_device_memory = 0
        self._shut_down = False

    def init_device(self) -> None:
        self.device = resolve_device(self.config.device.device, self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
            self.init_device_memory = torch.cuda.mem_get_info()[0]
        elif self.config.device.num_threads:
            torch.set_num_threads(self.config.device.num_threads)
        torch.manual_seed(self.config.model.seed)
        self.model_runner = ModelRunner(self.config, self.device)

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise AIOEngineError("worker used before init_device()")
        return self.model_runner

    def load_model(self) -> None:
        self._runner().load_model()

    def get_model_info(self) -> dict[str, Any]:
        return self._runner().model_info()

    def get_cache_block_size_bytes(self) -> int:
        return self._runner().get_cache_block_size_bytes()

    def determine_available_memory(self) -> int:
        runner = self._runner()
        assert self.device is not None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            runner.profile_run()
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            peak = self.init_device_memory - free + torch.cuda.max_memory_allocated(self.device) \
                - torch.cuda.memory_allocated(self.device)  # fmt: skip
            return max(int(total * self.config.cache.memory_utilization - peak), 0)
        runner.profile_run()  # exercises the largest step on CPU too, so a too-large budget fails here
        available = host_available_bytes()
        requested = self.config.cache.kv_cache_memory_bytes
        if requested is None:
            return int(min(available * CPU_KV_SHARE, CPU_KV_CAP))
        if requested > available:
            raise AIOEngineError(
                f"cache.kv_cache_memory_bytes={requested} but only {available} bytes of host memory are free; "
                "lower it (or cache.num_blocks)"
            )
        return requested

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self._runner().initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> float:
        start = time.perf_counter()
        self._runner().profile_run()
        seconds = time.perf_counter() - start
        logger.info("warm-up took %.2fs", seconds)
        return seconds

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        runner = self._runner()
        cache = runner.cache_engine
        assert cache is not None, "execute_model before initialize_from_config"
        cache.swap_in(scheduler_output.blocks_to_swap_in)
        cache.swap_out(scheduler_output.blocks_to_swap_out)
        cache.copy(scheduler_output.blocks_to_copy)
        return runner.execute_model(scheduler_output)

    def check_health(self) -> None:
        if self._shut_down:
            raise AIOEngineError("worker is shut down")

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        if self.model_runner is not None:
            self.model_runner.cache_engine = None
            self.model_runner.model = None
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
