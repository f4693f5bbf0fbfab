"""KV block manager: which cache blocks belong to which request. Bookkeeping only, no tensors."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from aioengine.messages import NULL_BLOCK_ID
from aioengine.scheduler.request import Request


class KVBlockManager:
    """A free list of fixed-size, reference-counted blocks; a request holds the blocks in ``request.block_ids``.

    The cache holds ``num_cache_blocks`` blocks; one of them is the null block (``NULL_BLOCK_ID``), so
    ``num_usable_blocks`` (what requests can hold) is one less. Several requests may hold one block (the
    samples of one prompt share its blocks, ``share``); a request about to write into a block it shares
    gets its own copy first (``allocate``), and the copy waits in ``pending_copies`` for the next step.
    """

    def __init__(self, num_cache_blocks: int, block_size: int) -> None:
        if num_cache_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_cache_blocks}")
        self.num_cache_blocks = num_cache_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(b for b in range(num_cache_blocks) if b != NULL_BLOCK_ID)
        self._refs = [0] * num_cache_blocks
        self.pending_copies: dict[int, list[int]] = {}
        """Copy-on-write decided since the last ``take_copies``: source block -> its new copies."""

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

    def allocate(self, request: Request, num_tokens: int, write_from: int | None = None) -> bool:
        """Grows the request's blocks to hold ``num_tokens`` tokens, and gives it its own copy of the block
        holding position ``write_from`` if it shares that block (it is about to write there). False, and
        no change, if the blocks needed are not free."""
        blocks = request.block_ids
        need = max(self.blocks_for(num_tokens) - len(blocks), 0)
        shared = None
        if write_from is not None:
            index = write_from // self.block_size
            if index < len(blocks) and self._refs[blocks[index]] > 1:
                shared = index
        if need + (shared is not None) > len(self._free):
            return False
        if shared is not None:
            src = blocks[shared]
            self._refs[src] -= 1
            blocks[shared] = self._take()
            self.pending_copies.setdefault(src, []).append(blocks[shared])
        blocks.extend(self._take() for _ in range(need))
        return True

    def share(self, source: Request, target: Request, num_tokens: int) -> None:
        """``target`` (holding no blocks) takes the blocks that hold ``source``'s first ``num_tokens`` tokens."""
        assert not target.block_ids, "share() into a request that holds blocks"
        shared = source.block_ids[: self.blocks_for(num_tokens)]
        for block in shared:
            self._refs[block] += 1
        target.block_ids = list(shared)

    def free(self, request: Request) -> None:
        """Drops the request's hold on its blocks; a block no one holds goes back to the free list (most
        recently used last, so that it is reused last)."""
        for block in reversed(request.block_ids):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        request.block_ids = []

    def take_copies(self) -> dict[int, list[int]]:
        """The copy-on-write decided since the last call (for the step being scheduled)."""
        copies, self.pending_copies = self.pending_copies, {}
        return copies

    def _take(self) -> int:
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def check(self, requests: Iterable[Request]) -> None:
        """Raises AssertionError unless every block's count equals the requests holding it, free blocks are
        held by no one and listed once, and the null block is never handed out. For tests."""
        holders = [0] * self.num_cache_blocks
        for request in requests:
            for block in request.block_ids:
                holders[block] += 1
        assert holders[NULL_BLOCK_ID] == 0, "the null block is held by a request"
        assert holders == self._refs, "block reference counts differ from the requests holding them"
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert all(self._refs[b] == 0 for b in free), "a held block is on the free list"
        assert len(free) + sum(1 for r in self._refs if r) == self.num_usable_blocks, "a block is lost"
