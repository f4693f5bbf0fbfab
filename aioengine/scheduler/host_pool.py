"""The host pool that preemption by swap moves KV blocks to: which host block holds whose KV.

Bookkeeping only, no tensors: the copies between the device and the host blocks are handed to the next
step (``SchedulerOutput.blocks_to_swap_out`` and ``blocks_to_swap_in``).
"""

from __future__ import annotations

from aioengine.scheduler.kv_manager import KVBlockManager
from aioengine.scheduler.request import Request


class HostSwapPool:
    """Reference-counted host blocks; a swapped-out request holds the blocks in ``request.swapped_blocks``."""

    def __init__(self, num_host_blocks: int) -> None:
        self._free = list(range(num_host_blocks - 1, -1, -1))
        """Host pool blocks no swapped-out request holds (popped from the end)."""
        self._refs = [0] * num_host_blocks
        """Swapped-out requests holding each host block (two that shared a device block share its copy)."""
        self._swap_in: dict[int, int] = {}
        self._swap_out: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Host blocks no swapped-out request holds."""
        return len(self._free)

    def swap_out(self, request: Request, kv: KVBlockManager) -> bool:
        """Moves the request's computed KV to the host pool (copied before the next forward); False, and no
        change, when the pool has too few free blocks. The last known token is computed again on resume,
        since its step's sampled token is dropped."""
        keep = min(request.num_computed_tokens, len(request.token_ids) - 1)
        blocks = request.block_ids[: kv.blocks_for(keep)]
        new = [b for b in blocks if b not in self._swap_out]  # a block shared with a request swapped out now
        if not blocks or len(new) > len(self._free):
            return False
        for block in new:
            self._swap_out[block] = self._free.pop()
        host = [self._swap_out[b] for b in blocks]
        for h in host:
            self._refs[h] += 1
        kv.free(request)
        request.swapped_blocks = host
        request.num_computed_tokens = keep
        return True

    def swap_in(self, request: Request, kv: KVBlockManager) -> None:
        """Copies the request's host blocks into the device blocks it was just allocated (before the next
        forward), and drops its hold on them."""
        for host, device in zip(request.swapped_blocks, request.block_ids, strict=False):
            if host in self._swap_in:  # another request resumes from the same copy: take it from there
                kv.pending_copies.setdefault(self._swap_in[host], []).append(device)
            else:
                self._swap_in[host] = device
        self.release(request)

    def release(self, request: Request) -> None:
        """Drops the request's hold on its host blocks (its KV is back on the device, or not needed)."""
        for h in request.swapped_blocks:
            self._refs[h] -= 1
            if self._refs[h] == 0:
                self._free.append(h)
        request.swapped_blocks = []

    def take_swaps(self) -> tuple[dict[int, int], dict[int, int]]:
        """The copies the next step makes, host -> device (swap in) and device -> host (swap out); cleared."""
        swap_in, self._swap_in = self._swap_in, {}
        swap_out, self._swap_out = self._swap_out, {}
        return swap_in, swap_out
