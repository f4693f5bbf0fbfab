"""Specification of paged attention: a mixed batch over a block-scattered cache equals dense causal attention."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from aioengine.model.attention import AttentionMetadata, PrefillChunk, _decode, paged_attention, split_decode_rows

HEADS, KV_HEADS, DIM = 4, 2, 8
BLOCK_SIZE, NUM_BLOCKS = 4, 64
SCALE = DIM**-0.5


@dataclass
class Seq:
    """One request: its whole context densely, and the part this step computes."""

    start: int  # tokens already in the cache
    num_new: int  # tokens this step (1 for a decode)
    q: torch.Tensor  # [L, H, D] for every position 0..L-1
    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor
    block_ids: list[int]

    @property
    def length(self) -> int:
        return self.start + self.num_new

    def slot(self, pos: int) -> int:
        return self.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def dense_causal_attention(seq: Seq) -> torch.Tensor:
    """Plain causal attention over the whole sequence; rows of this step's tokens, [num_new, H, D]."""
    q = seq.q.transpose(0, 1).unsqueeze(0)
    k = seq.k.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1).unsqueeze(0)
    v = seq.v.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)
    return out.squeeze(0).transpose(0, 1)[seq.start :]


def build_step(
    placement_seed: int = 0,
) -> tuple[list[Seq], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """2 decodes, then a prefill chunk from position 0 and one continuing a prompt at position 13.

    Blocks are a random permutation of the cache, and the cache is random garbage outside the
    cached context, so reading a wrong slot changes the result.
    """
    gen = torch.Generator().manual_seed(0)  # the data: the same for every placement
    shapes = [(20, 1), (8, 1), (0, 11), (13, 10)]  # (start, num_new); the 2nd decode opens a new block
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(placement_seed)).tolist()
    seqs = []
    for start, num_new in shapes:
        length = start + num_new
        nb = -(-length // BLOCK_SIZE)
        seqs.append(
            Seq(
                start,
                num_new,
                torch.randn(length, HEADS, DIM, generator=gen),
                torch.randn(length, KV_HEADS, DIM, generator=gen),
                torch.randn(length, KV_HEADS, DIM, generator=gen),
                [free.pop() for _ in range(nb)],
            )
        )
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, generator=gen)
    flat = cache.view(2, NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, DIM)
    for s in seqs:  # what earlier steps wrote
        for pos in range(s.start):
            flat[0, s.slot(pos)], flat[1, s.slot(pos)] = s.k[pos], s.v[pos]

    q = torch.cat([s.q[s.start :] for s in seqs])
    k = torch.cat([s.k[s.start :] for s in seqs])
    v = torch.cat([s.v[s.start :] for s in seqs])
    slots = torch.tensor([s.slot(p) for s in seqs for p in range(s.start, s.length)])

    decodes, prefills = seqs[:2], seqs[2:]
    max_blocks = max(len(s.block_ids) for s in decodes)
    tables = torch.tensor([s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in decodes])
    lengths = torch.tensor([s.length for s in decodes])
    mask = (torch.arange(max_blocks * BLOCK_SIZE)[None] < lengths[:, None]).view(len(decodes), 1, 1, -1)
    chunks, token_start = [], len(decodes)
    for s in prefills:
        chunks.append(PrefillChunk(token_start, s.num_new, s.start, torch.tensor(s.block_ids)))
        token_start += s.num_new
    meta = AttentionMetadata(slots, len(decodes), tables, mask, chunks)
    return seqs, q, k, v, cache, meta


def test_mixed_batch_equals_dense_causal_attention() -> None:
    seqs, q, k, v, cache, meta = build_step()
    out = paged_attention(q, k, v, cache, meta, SCALE)

    expected = torch.cat([dense_causal_attention(s) for s in seqs])
    assert out.shape == q.shape
    row = 0
    for i, s in enumerate(seqs):
        torch.testing.assert_close(out[row : row + s.num_new], expected[row : row + s.num_new], atol=1e-5, rtol=0,
                                   msg=lambda m, i=i: f"sequence {i}: {m}")  # fmt: skip
        row += s.num_new


def test_step_kv_lands_at_slot_mapping_and_nowhere_else() -> None:
    _, q, k, v, cache, meta = build_step()
    before = cache.clone()
    paged_attention(q, k, v, cache, meta, SCALE)

    flat, flat_before = cache.view(2, -1, KV_HEADS, DIM), before.view(2, -1, KV_HEADS, DIM)
    slots = meta.slot_mapping
    assert torch.equal(flat[0, slots], k)
    assert torch.equal(flat[1, slots], v)
    others = torch.ones(flat.shape[1], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(flat[:, others], flat_before[:, others])


@pytest.mark.parametrize("placement_seed", [1, 2])
def test_result_does_not_depend_on_which_blocks_hold_the_context(placement_seed: int) -> None:
    seqs, q, k, v, cache, meta = build_step()
    moved_seqs, *moved_inputs = build_step(placement_seed)
    assert [s.block_ids for s in moved_seqs] != [s.block_ids for s in seqs]
    assert torch.equal(moved_inputs[0], q)

    out = paged_attention(q, k, v, cache, meta, SCALE)
    moved = paged_attention(*moved_inputs, SCALE)
    torch.testing.assert_close(moved, out, atol=1e-6, rtol=0)


def test_decode_rows_split_only_when_contexts_differ_enough() -> None:
    assert split_decode_rows([4] * 12) is None
    assert split_decode_rows([1, 20] * 2) is None  # fewer rows than worth splitting
    groups = split_decode_rows([1, 1, 1, 1, 1, 1, 1, 1, 20, 19])
    assert groups is not None
    (short, short_width), (long, long_width) = groups
    assert sorted(short + long) == list(range(10))
    assert (short_width, long_width) == (1, 20)
    assert set(long) == {8, 9}


def test_grouped_decode_equals_one_group() -> None:
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 16, 4, 64
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)
    contexts = [3, 2, 5, 4, 1, 2, 3, 30, 29, 31]
    counts = [-(-c // block_size) for c in contexts]
    width = max(counts)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(contexts), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(counts):
        tables[i, :n] = perm[used : used + n]
        used += n
    mask = (torch.arange(width * block_size)[None] < torch.tensor(contexts)[:, None]).view(len(contexts), 1, 1, -1)
    q = torch.randn(len(contexts), heads, dim, generator=gen)
    groups = split_decode_rows(counts)
    assert groups is not None
    base = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(contexts), tables, mask, [])
    split = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(contexts), tables, mask, [],
                              decode_groups=[(torch.tensor(rows), w) for rows, w in groups])  # fmt: skip
    torch.testing.assert_close(_decode(q, cache, split, 0.25), _decode(q, cache, base, 0.25), rtol=1e-5, atol=1e-6)
