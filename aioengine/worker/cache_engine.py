"""CacheEngine, as in the seeds: allocates the paged KV cache once and moves blocks on request.

Per layer one tensor ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K and V). Block
allocation after start-up is the scheduler's bookkeeping; nothing here mallocs per step.
"""

from __future__ import annotations

import math
import mmap

import torch

from aioengine.int_tensors import int64_tensor


class CacheEngine:
    """Owns the KV cache of one worker: ``device_cache`` on the worker's device (host memory when that
    device is the CPU), and an optional ``host_cache`` pool that swap preemption moves blocks to."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        num_cache_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        num_host_blocks: int = 0,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.block_size = block_size
        self.num_cache_blocks = num_cache_blocks
        self.num_host_blocks = num_host_blocks
        self.dtype = dtype
        self.device = device
        self.device_cache = self._allocate(num_cache_blocks, device)
        self.host_cache = self._allocate(num_host_blocks, torch.device("cpu")) if num_host_blocks else []

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def _allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        shape = self.kv_cache_shape(num_blocks)
        if device.type == "cpu":
            if self.device.type == "cuda" and torch.cuda.is_available():  # the swap pool: pinned, for async copies
                return [torch.zeros(shape, dtype=self.dtype, pin_memory=True) for _ in range(self.num_layers)]
            return [host_zeros(shape, self.dtype) for _ in range(self.num_layers)]
        return [torch.empty(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]

    @staticmethod
    def get_cache_block_size(
        num_layers: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> int:
        """Bytes of one block across all layers: ``num_layers * 2 * block_size * kv_heads * head_size * dtype``."""
        return num_layers * 2 * block_size * num_kv_heads * head_size * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.device_cache)

    def swap_in(self, src_to_dst: dict[int, int]) -> None:
        """Host blocks -> device blocks."""
        _swap_blocks(self.host_cache, self.device_cache, src_to_dst)

    def swap_out(self, src_to_dst: dict[int, int]) -> None:
        """Device blocks -> host blocks."""
        _swap_blocks(self.device_cache, self.host_cache, src_to_dst)

    def copy(self, src_to_dsts: dict[int, list[int]]) -> None:
        """Device block -> device blocks (copy-on-write)."""
        if not src_to_dsts:
            return
        pairs = [(s, d) for s, dsts in src_to_dsts.items() for d in dsts]
        src = int64_tensor([p[0] for p in pairs], self.device)
        dst = int64_tensor([p[1] for p in pairs], self.device)
        for layer in self.device_cache:
            layer[:, dst] = layer[:, src]


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in host memory whose pages are mapped, zero-filled, by the OS as they are first touched.

    ``torch.zeros`` writes every page at once: for a cache of a few GiB that is seconds of page faults at
    start-up (about 0.7 GB/s in a VM), for blocks most workloads never reach. An anonymous mapping is zero
    by the OS's guarantee, so the cache reads as zeros everywhere (the torch decode path reads, and masks,
    slots no token wrote) while memory is only taken as blocks are used, and given back to the OS when
    the tensor is freed. The price: an over-committed host fails when the cache fills, not at start-up.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes < mmap.PAGESIZE:  # a mapping is whole pages: not worth one for a few blocks
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


def _swap_blocks(src_cache: list[torch.Tensor], dst_cache: list[torch.Tensor], src_to_dst: dict[int, int]) -> None:
    if not src_to_dst:
        return
    if not src_cache or not dst_cache:
        raise RuntimeError("swap requested but the host cache has no blocks (KVCacheConfig.num_host_blocks is 0)")
    src = int64_tensor(src_to_dst.keys(), src_cache[0].device)
    dst = int64_tensor(src_to_dst.values(), dst_cache[0].device)
    for s, d in zip(src_cache, dst_cache, strict=True):
        d[:, dst] = s[:, src].to(d.device, non_blocking=True)
