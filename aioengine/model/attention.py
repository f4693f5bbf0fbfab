"""Paged attention in plain torch over one mixed batch of decode tokens and prefill chunks.

The batch is laid out decodes first: the first ``num_decodes`` tokens each belong to a
different request with a query of length one; the prefill chunks follow, one request each.
KV of every token is written into the paged cache at ``slot_mapping`` before attention, so
decode and later chunks read their whole context from the cache through block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    """One request's chunk of ``num_tokens`` query tokens at positions ``start_pos ..``."""

    token_start: int
    num_tokens: int
    start_pos: int
    block_ids: torch.Tensor  # [num_blocks_needed] int64, covers start_pos + num_tokens


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = padded token that writes no KV
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [Bd, max_blocks] int64
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] bool, True = attend
    prefills: list[PrefillChunk]
    has_padding: bool = False
    decode_groups: list[tuple[torch.Tensor, int]] | None = None
    """Eager only: decode rows split by context length as (rows, width in blocks), so short rows do not
    gather and attend over the longest row's blocks. None: one group as wide as the block table."""
    decode_kernel: Callable[..., None] | None = None
    """CPU float32: the C++ paged decode attention (``cpu_kernels``), which reads each row's own context
    in place; it needs ``decode_context_lens`` and ignores the mask and groups. None: the torch path."""
    decode_context_lens: torch.Tensor | None = None  # [Bd] int64, position + 1 of each decode token
    prefill_kernel: Callable[..., None] | None = None
    """CPU float32 (AVX-512 and AVX2 builds): the C++ causal attention of a prefill chunk (``cpu_kernels``), which reads
    the chunk's whole context, its own K and V included (written first), from the cache through its block ids.
    None: SDPA."""


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store this step's K and V ([T, Hkv, D]) into the layer's cache [2, blocks, block_size, Hkv, D]."""
    slots = meta.slot_mapping
    if meta.has_padding:
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    flat = kv_cache.flatten(1, 2)  # [2, blocks * block_size, Hkv, D], a view
    flat[0].index_copy_(0, slots, k)
    flat[1].index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (this step's). Returns [T, H, D]."""
    write_kv(kv_cache, k, v, meta)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode(q[:nd], kv_cache, meta, scale)
    for chunk in meta.prefills:
        s, n = chunk.token_start, chunk.num_tokens
        if meta.prefill_kernel is not None:
            meta.prefill_kernel(q[s : s + n], kv_cache, chunk.block_ids, chunk.start_pos, scale, out[s : s + n])
        else:
            out[s : s + n] = _prefill(q[s : s + n], k[s : s + n], v[s : s + n], kv_cache, chunk, scale)
    return out


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given blocks as [..., Hkv, L, D] for SDPA."""
    # index_select along the block dim is several times faster on CPU than advanced indexing
    kv = kv_cache.index_select(1, block_ids.flatten())  # [2, B * nb, bs, Hkv, D]
    kv = kv.view(2, *block_ids.shape[:-1], -1, *kv_cache.shape[-2:])  # [2, (B,) nb * bs, Hkv, D]
    return kv[0].transpose(-3, -2), kv[1].transpose(-3, -2)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    tables, mask = meta.decode_block_tables, meta.decode_mask
    assert tables is not None
    if meta.decode_kernel is not None:
        assert meta.decode_context_lens is not None
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.stride(-1) != 1 or (q.shape[1] > 1 and q.stride(1) != q.shape[-1]):  # rows may be strided, heads not
            q = q.contiguous()
        meta.decode_kernel(q, kv_cache, tables, meta.decode_context_lens, scale, out)
        return out
    assert mask is not None
    if meta.decode_groups is None:
        return _decode_rows(q, kv_cache, tables, mask, scale)
    out = torch.zeros_like(q)  # rows in no group are padding: zeros, never read
    block_size = kv_cache.shape[2]
    for rows, width in meta.decode_groups:
        out[rows] = _decode_rows(q[rows], kv_cache, tables[rows, :width], mask[rows, :, :, : width * block_size], scale)
    return out


def _decode_rows(
    q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    keys, values = _gather(kv_cache, tables)  # [B, Hkv, L, D]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def split_decode_rows(
    block_counts: list[int], min_rows: int = 8, min_saving: float = 0.25
) -> list[tuple[list[int], int]] | None:
    """Splits decode rows in two by context length when that saves ``min_saving`` of the attention work.

    Returns [(rows, width in blocks), ...] or None (one group). Host-side, for eager steps only.
    """
    n = len(block_counts)
    if n < min_rows:
        return None
    order = sorted(range(n), key=block_counts.__getitem__)
    widths = [block_counts[i] for i in order]
    whole = n * widths[-1]
    best_k, best_cost = 0, whole
    for k in range(1, n):
        cost = k * widths[k - 1] + (n - k) * widths[-1]
        if cost < best_cost:
            best_k, best_cost = k, cost
    if best_cost > whole * (1 - min_saving):
        return None
    return [(order[:best_k], widths[best_k - 1]), (order[best_k:], widths[-1])]


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if chunk.start_pos == 0:
        # The whole context is this chunk: attend to it directly, no cache read needed.
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        ctx = chunk.start_pos + chunk.num_tokens
        keys, values = _gather(kv_cache, chunk.block_ids)
        keys, values = keys[:, :ctx].unsqueeze(0), values[:, :ctx].unsqueeze(0)
        rows = torch.arange(chunk.num_tokens, device=q.device).unsqueeze(1) + chunk.start_pos
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows  # causal, offset by the cached part
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
