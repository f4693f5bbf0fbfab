"""CPUWorker: the KV cache lives in host memory, sized by config rather than by a device counter."""

from __future__ import annotations

import os

import torch

from aioengine.errors import AIOEngineError
from aioengine.worker.worker import Worker

# Default KV budget when cache.kv_cache_memory_bytes is unset: a share of free host memory,
# capped so an engine inside a larger application does not take the whole machine.
CPU_KV_SHARE = 0.25
CPU_KV_CAP = 4 << 30


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


class CPUWorker(Worker):
    """Runs the model on the host CPU."""

    def _bind_device(self) -> None:
        threads = self.config.device.num_threads
        tp = self.config.parallel.tensor_parallel_size
        if threads is None and tp > 1:  # the ranks share the host's cores: no rank oversubscribes them
            threads = max(1, (os.cpu_count() or 1) // tp)
        if threads:
            torch.set_num_threads(threads)

    def determine_available_memory(self) -> int:
        # No profiling forward: host memory is read from the OS, not from a measured peak, and the largest
        # step's activations (tens of MB) are small beside the cache. Skipping it saves a whole forward
        # at the largest step (seconds on CPU) at every start-up.
        available = host_available_bytes()
        requested = self.config.cache.kv_cache_memory_bytes
        if requested is None:
            return int(min(available * CPU_KV_SHARE, CPU_KV_CAP))
        if requested > available:
            raise AIOEngineError(
                f"cache.kv_cache_memory_bytes={requested} but only {available} bytes of host memory are free; "
                "lower it (or set cache.num_blocks)"
            )
        return requested
