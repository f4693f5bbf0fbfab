"""CUDAWorker: binds its GPU, sizes the KV cache by a profiling forward, captures decode graphs."""

from __future__ import annotations

import os

import torch

from aioengine.worker.worker import Worker


class CUDAWorker(Worker):
    """Runs the model on one CUDA device (``cuda:local_rank`` unless the config names one)."""

    init_device_memory = 0
    """Free device memory when the worker bound its device (before the model was loaded)."""

    def _bind_device(self) -> None:
        assert self.device is not None
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")  # seeds: keeps NCCL from leaking memory
        torch.cuda.set_device(self.device)
        torch.cuda.empty_cache()
        self.init_device_memory = torch.cuda.mem_get_info(self.device)[0]

    def determine_available_memory(self) -> int:
        """Seeds formula: ``total * memory_utilization - peak`` after a forward at the largest step."""
        assert self.device is not None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._runner().profile_run()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Used now (weights, other tenants) plus the activation peak the profiling forward reached.
        peak = (total - free) + torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        return max(int(total * self.config.cache.memory_utilization - peak), 0)

    def _release_device_memory(self) -> None:
        torch.cuda.empty_cache()
