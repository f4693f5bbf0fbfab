"""KV block manager: which cache blocks belong to which request. Bookkeeping only, no tensors."""

from __future__ import annotations

from collections import deque

from aioengine.scheduler.request import Request


class KVBlockManager:
    """A free list of fixed-size blocks; a request owns the blocks listed in ``request.block_ids``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

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

    def reset(self, num_blocks: int | None = None) -> None:
        """Forgets every allocation (used when the cache is rebuilt)."""
        if num_blocks is not None:
            self.num_blocks = num_blocks
        self._free = deque(range(self.num_blocks))
