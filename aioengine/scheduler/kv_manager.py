"""KV block manager: which cache blocks belong to which request. Bookkeeping only, no tensors."""

from __future__ import annotations

from collections import deque

from aioengine.messages import NULL_BLOCK_ID
from aioengine.scheduler.request import Request


class KVBlockManager:
    """A free list of fixed-size blocks; a request owns the blocks listed in ``request.block_ids``.

    The cache holds ``num_cache_blocks`` blocks; one of them is the null block (``NULL_BLOCK_ID``), so
    ``num_usable_blocks`` (what requests can hold) is one less.
    """

    def __init__(self, num_cache_blocks: int, block_size: int) -> None:
        if num_cache_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_cache_blocks}")
        self.num_cache_blocks = num_cache_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(b for b in range(num_cache_blocks) if b != NULL_BLOCK_ID)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that requests can hold: all but the null block."""
        return self.num_cache_blocks - 1

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one request could ever hold: every usable block."""
        return self.num_usable_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grows the request's blocks to hold ``num_tokens`` tokens; False (and no change) if they don't fit."""
        need = self.blocks_for(num_tokens) - len(request.block_ids)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        request.block_ids.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, request: Request) -> None:
        # Most recently used blocks go back last so that they are reused last.
        self._free.extend(reversed(request.block_ids))
        request.block_ids = []
