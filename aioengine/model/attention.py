"""Paged attention in plain torch over one mixed batch of decode tokens and prefill chunks.

The batch is laid out decodes first: the first ``num_decodes`` tokens each belong to a
different request with a query of length one; the prefill chunks follow, one request each.
KV of every token is written into the paged cache at ``slot_mapping`` before attention, so
decode and later chunks read their whole context from the cache through block tables.
"""

from __future__ import annotations

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
        out[s : s + n] = _prefill(q[s : s + n], k[s : s + n], v[s : s + n], kv_cache, chunk, scale)
    return out


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given blocks as [..., Hkv, L, D] for SDPA."""
    # index_select along the block dim is several times faster on CPU than advanced indexing
    kv = kv_cache.index_select(1, block_ids.flatten())  # [2, B * nb, bs, Hkv, D]
    kv = kv.view(2, *block_ids.shape[:-1], -1, *kv_cache.shape[-2:])  # [2, (B,) nb * bs, Hkv, D]
    return kv[0].transpose(-3, -2), kv[1].transpose(-3, -2)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    assert meta.decode_block_tables is not None and meta.decode_mask is not None
    keys, values = _gather(kv_cache, meta.decode_block_tables)  # [Bd, Hkv, L, D]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)


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
