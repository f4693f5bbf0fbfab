"""KV block manager: which cache blocks belong to which request, and which hold a known prefix.

Bookkeeping only, no tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import cast

from aioengine.messages import NULL_BLOCK_ID
from aioengine.scheduler.request import Request

BlockKey = tuple[int | None, tuple[int, ...], Hashable]
"""What a full block's KV depends on: its parent block's key hash (None for the first block), its tokens,
and for the first block what else changes the KV (the weights version, the request's cache salt). Keys
are compared whole, tokens included, so two prefixes share a block only if their tokens are equal."""


class KVBlockManager:
    """Fixed-size, reference-counted blocks; a request holds the blocks in ``request.block_ids``.

    The cache holds ``num_cache_blocks`` blocks; one of them is the null block (``NULL_BLOCK_ID``), so
    ``num_usable_blocks`` (what requests can hold) is one less. Several requests may hold one block (the
    samples of one prompt share its blocks, ``share``); a request about to write into a block it shares
    gets its own copy first (``allocate``), and the copy waits in ``pending_copies`` for the next step.

    With prefix caching, every full block whose tokens are known is registered under its ``BlockKey``.
    A freed block keeps its contents and its key and waits in the free queue, least recently freed first;
    it leaves the cache only when a new block is needed, no block without a key is free and it is the
    oldest (every operation O(1)). A new request's leading full blocks that are cached are taken instead
    of computed (``cached_prefix``, ``adopt``); ``reset`` forgets every key (new weights, a sleep, on demand).

    Free blocks that hold no prefix (never used, a request's last partial block, every block without
    prefix caching) are handed out first, the most recently freed on top: its memory is mapped and likely
    still in the CPU's caches, and a host cache the OS maps as blocks are first written (``host_zeros``)
    grows only as far as the most blocks ever held at once instead of, block by block, to all of it.
    """

    def __init__(self, num_cache_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_cache_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_cache_blocks}")
        self.num_cache_blocks = num_cache_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict()
        """Blocks no request holds that hold a cached prefix, least recently freed first."""
        self._plain: list[int] = [b for b in reversed(range(num_cache_blocks)) if b != NULL_BLOCK_ID]
        """Blocks no request holds that hold no prefix, the next to be handed out last (block 1 first)."""
        self._refs = [0] * num_cache_blocks
        self._keys: list[BlockKey | None] = [None] * num_cache_blocks
        self.cached: dict[BlockKey, int] = {}
        """Key -> the block holding that prefix's KV (held or free)."""
        self.epoch = 0
        """Counts resets: a request admitted before the last one computed its KV on what the reset
        dropped, so its blocks are never registered (``Request.cache_epoch``)."""
        self.weights_version = 0
        self.num_query_tokens = 0
        """Prompt tokens of admitted requests that looked up the cache."""
        self.num_hit_tokens = 0
        """Of those, the tokens whose KV was found cached."""
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
        """Blocks no request holds (cached ones among them: they are reused when needed)."""
        return len(self._free) + len(self._plain)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- holding blocks ----------------------------------------------------------------------------------
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
        if not need and shared is None:
            return True  # most decode steps: the last block has room
        if need + (shared is not None) > self.num_free_blocks:
            return False
        # A new list, never the old one changed: the steps scheduled before keep the table they were sent with
        # (``describe`` hands the request's own list out, uncopied).
        blocks = list(blocks)
        if shared is not None:
            src = blocks[shared]
            self._refs[src] -= 1
            blocks[shared] = self._take()
            self.pending_copies.setdefault(src, []).append(blocks[shared])
        blocks.extend(self._take() for _ in range(need))
        request.block_ids = blocks
        return True

    def share(self, source: Request, target: Request, num_tokens: int) -> None:
        """``target`` (holding no blocks) takes the blocks that hold ``source``'s first ``num_tokens`` tokens."""
        assert not target.block_ids, "share() into a request that holds blocks"
        shared = source.block_ids[: self.blocks_for(num_tokens)]
        for block in shared:
            self._refs[block] += 1
        target.block_ids = list(shared)
        target.cache_epoch = source.cache_epoch

    def free(self, request: Request) -> None:
        """Drops the request's hold on its blocks; a block no one holds goes to the end of the free queue if it
        holds a prefix (the request's last block first, so its first blocks, which others share most, stay
        cached longest), else on top of the blocks handed out first."""
        for block in reversed(request.block_ids):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._release(block)
        request.block_ids = []
        request.num_registered_blocks = 0

    def take_copies(self) -> dict[int, list[int]]:
        """The copy-on-write decided since the last call (for the step being scheduled)."""
        copies, self.pending_copies = self.pending_copies, {}
        return copies

    def _release(self, block: int) -> None:
        """Puts a block no one holds with the free blocks: in the queue if it holds a prefix, else on top."""
        if self._keys[block] is not None:
            self._free[block] = None
        else:
            self._plain.append(block)

    def _take(self) -> int:
        """The next free block: the one that held no prefix freed last, else the oldest cached one (dropped
        from the cache)."""
        if self._plain:
            block = self._plain.pop()
        else:
            block, _ = self._free.popitem(last=False)
            key = self._keys[block]
            if key is not None:
                del self.cached[key]
                self._keys[block] = None
        self._refs[block] = 1
        return block

    # ---- the prefix cache ----------------------------------------------------------------------------------
    def cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks holding the KV of the request's leading full blocks, as far as they go, but never
        the block with its last token (one token must be computed to sample). Changes nothing."""
        if not self.enable_prefix_caching or request.prompt_logprobs_from is not None:
            return []  # prompt logprobs need every prompt position's logits
        self._start_epoch(request)
        hits = []
        for key in self._block_keys(request, (len(request.token_ids) - 1) // self.block_size):
            block = self.cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_needed(self, hits: list[int]) -> int:
        """Free blocks that adopting ``hits`` takes (the ones no request holds now)."""
        return sum(1 for block in hits if self._refs[block] == 0)

    def adopt(self, request: Request, hits: list[int]) -> None:
        """The request (holding no blocks) takes ``hits`` from ``cached_prefix`` as its first blocks, their KV
        computed; counts the lookup in the hit rate."""
        assert not request.block_ids, "adopt() into a request that holds blocks"
        for block in hits:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        request.block_ids = list(hits)
        request.num_computed_tokens = len(hits) * self.block_size
        request.num_registered_blocks = len(hits)
        if self.enable_prefix_caching and request.prompt_logprobs_from is None:
            self.num_query_tokens += len(request.token_ids)
            self.num_hit_tokens += request.num_computed_tokens

    def register(self, request: Request) -> list[int]:
        """Registers the request's full blocks whose tokens are known and whose KV is computed (or being
        computed by a step in flight: steps run in order, so a later reader finds it written). Returns the
        blocks it entered in the cache (what ``unregister`` takes out again)."""
        if not self.enable_prefix_caching or request.cache_epoch != self.epoch:
            return []
        full = min(request.num_computed_tokens, len(request.token_ids)) // self.block_size
        if full <= request.num_registered_blocks:
            return []
        keys = self._block_keys(request, full)
        entered = []
        for index in range(request.num_registered_blocks, full):
            block = request.block_ids[index]
            key = keys[index]
            if self._keys[block] is None and key not in self.cached:
                self.cached[key] = block
                self._keys[block] = key
                entered.append(block)
        request.num_registered_blocks = full
        return entered

    def unregister(self, blocks: Iterable[int]) -> None:
        """Takes ``blocks`` (from ``register``) out of the cache again: the step that would have computed
        their KV was revoked before it ran."""
        for block in blocks:
            key = self._keys[block]
            if key is not None and self.cached.get(key) == block:
                del self.cached[key]
            self._forget(block)

    def reset(self, weights_version: int) -> int:
        """Forgets every cached prefix (the KV would differ now); blocks in use stay with their requests.
        Returns how many blocks were cached."""
        count = len(self.cached)
        for block in self.cached.values():
            self._forget(block)
        self.cached.clear()
        self.epoch += 1
        self.weights_version = weights_version
        return count

    def _forget(self, block: int) -> None:
        """Drops the block's key; a free one moves from the queue of cached blocks to those handed out first."""
        self._keys[block] = None
        if block in self._free:
            del self._free[block]
            self._plain.append(block)

    def _start_epoch(self, request: Request) -> None:
        """A request looking up the cache computes its KV now: it belongs to the current epoch."""
        if request.cache_epoch != self.epoch:
            request.cache_epoch = self.epoch
            request.block_keys = []

    def _block_keys(self, request: Request, count: int) -> list[BlockKey]:
        """The keys of the request's first ``count`` full blocks, extended as tokens come."""
        keys = cast(list[BlockKey], request.block_keys)
        bs = self.block_size
        tokens = request.token_ids
        while len(keys) < count:
            i = len(keys)
            parent = hash(keys[-1]) if keys else None
            extra = (self.weights_version, request.cache_salt) if i == 0 else None
            keys.append((parent, tuple(tokens[i * bs : (i + 1) * bs]), extra))
        return keys[:count] if len(keys) > count else keys

    # ---- for tests ---------------------------------------------------------------------------------------------
    def check(self, requests: Iterable[Request]) -> None:
        """Raises AssertionError unless every block's count equals the requests holding it, free blocks are
        held by no one and listed once, the null block is never handed out, and the cache map and the
        blocks' keys agree."""
        holders = [0] * self.num_cache_blocks
        for request in requests:
            for block in request.block_ids:
                holders[block] += 1
        assert holders[NULL_BLOCK_ID] == 0, "the null block is held by a request"
        assert holders == self._refs, "block reference counts differ from the requests holding them"
        free = [*self._free, *self._plain]
        assert all(self._refs[b] == 0 for b in free), "a held block is among the free ones"
        assert len(set(free)) == len(free), "a free block is listed twice"
        assert NULL_BLOCK_ID not in free, "the null block is among the free ones"
        assert all(self._keys[b] is not None for b in self._free), "a block without a key waits with the cached ones"
        assert all(self._keys[b] is None for b in self._plain), "a cached block waits with those handed out first"
        assert len(free) + sum(1 for r in self._refs if r) == self.num_usable_blocks, "a block is lost"
        for key, block in self.cached.items():
            assert self._keys[block] == key, f"block {block} is cached under a key it does not hold"
        keyed = [b for b, key in enumerate(self._keys) if key is not None]
        assert len(keyed) == len(self.cached), "a block holds a key the cache map does not list"
