"""Specification of the C++ prefill attention (``paged_prefill_attention``, AVX-512 and AVX2 builds): one prompt
chunk, causal, over its whole context in the paged cache, equal to the SDPA path (``attention._prefill``) it
replaces, which stays for what the kernel does not cover (neither AVX-512 nor AVX2, a head size off 16, other
dtypes). A mixed batch through ``prepare_inputs``, with and without it, is checked in ``test_cpu_kernels.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from aioengine.model.attention import PrefillChunk, _prefill


@pytest.fixture
def prefill_kernel(kernel: ModuleType) -> Callable[..., None]:
    if not hasattr(kernel, "paged_prefill_attention"):
        pytest.skip("the kernels were built without AVX-512 or AVX2: prefill attention runs SDPA")
    return kernel.paged_prefill_attention  # type: ignore[no-any-return]


def chunk_inputs(heads: int, kv_heads: int, dim: int, block_size: int, start: int, n: int,
                 seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """A chunk of n tokens at positions start.., q as the model has it (a strided view of the fused q/k/v
    rows), its whole context in shuffled blocks of a cache with spare blocks of random values, and its own
    k and v as write_kv stored them."""
    gen = torch.Generator().manual_seed(seed)
    context = start + n
    needed = -(-context // block_size)
    cache = torch.randn(2, needed + 4, block_size, kv_heads, dim, generator=gen)
    blocks = torch.randperm(needed + 4, generator=gen)[:needed]
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.arange(start, context)
    slots = blocks[positions // block_size] * block_size + positions % block_size
    flat = cache.flatten(1, 2)
    return {"q": qkv[:, : heads * dim].view(n, heads, dim), "kv_cache": cache, "block_ids": blocks,
            "k": flat[0][slots].clone(), "v": flat[1][slots].clone(), "start": start}  # fmt: skip


def sdpa(inputs: dict[str, Any], scale: float = 0.2) -> torch.Tensor:
    q = inputs["q"]
    chunk = PrefillChunk(0, q.shape[0], inputs["start"], inputs["block_ids"])
    return _prefill(q, inputs["k"], inputs["v"], inputs["kv_cache"], chunk, scale)


def kernel_prefill(prefill_kernel: Callable[..., None], inputs: dict[str, Any], scale: float = 0.2) -> torch.Tensor:
    q = inputs["q"]
    out = torch.full(q.shape, float("nan"))  # every element must be written
    prefill_kernel(q, inputs["kv_cache"], inputs["block_ids"], inputs["start"], scale, out)
    return out


@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 7), (0, 8), (0, 9), (0, 100), (5, 1), (37, 20), (64, 33)])
@pytest.mark.parametrize("dim", [64, 128, 16, 80])  # 80: a last group of columns narrower than 64
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (9, 3), (8, 1), (4, 4)])
def test_kernel_equals_sdpa_on_a_chunk(prefill_kernel: Callable[..., None], heads: int, kv_heads: int, dim: int,
                                       start: int, n: int) -> None:  # fmt: skip
    # Chunks from position 0 and continuing a cached prefix; tiles of 8 rows full, partial and single; 16-key
    # chunks crossed by the causal diagonal anywhere.
    inputs = chunk_inputs(heads, kv_heads, dim, 16, start, n, seed=heads * dim + start + n)
    torch.testing.assert_close(kernel_prefill(prefill_kernel, inputs), sdpa(inputs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_kernel_equals_sdpa_at_any_block_size(prefill_kernel: Callable[..., None], block_size: int) -> None:
    inputs = chunk_inputs(6, 2, 64, block_size, 13, 50, seed=block_size)
    torch.testing.assert_close(kernel_prefill(prefill_kernel, inputs), sdpa(inputs), atol=1e-5, rtol=1e-5)


def test_kernel_equals_sdpa_on_a_long_chunk(prefill_kernel: Callable[..., None]) -> None:
    inputs = chunk_inputs(9, 3, 64, 16, 0, 512)  # the scheduler's default token budget in one chunk
    torch.testing.assert_close(kernel_prefill(prefill_kernel, inputs), sdpa(inputs), atol=1e-5, rtol=1e-5)


def test_kernel_reads_no_position_past_the_chunk(prefill_kernel: Callable[..., None]) -> None:
    inputs = chunk_inputs(4, 2, 64, 16, 3, 10)  # context 13 of a 16-slot block: slots 13-15 hold other data
    want = kernel_prefill(prefill_kernel, inputs)
    block = int(inputs["block_ids"][0])
    inputs["kv_cache"][:, block, 13:] = float("nan")
    spare = inputs["kv_cache"].shape[1] - 1
    inputs["block_ids"] = torch.cat([inputs["block_ids"], torch.tensor([spare])])  # a table longer than needed
    torch.testing.assert_close(kernel_prefill(prefill_kernel, inputs), want, atol=0, rtol=0)


BAD_INPUTS: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], str]] = {
    "float64": (lambda a: {**a, "q": a["q"].double()}, "float32 only"),
    "int32 block ids": (lambda a: {**a, "block_ids": a["block_ids"].int()}, "block_ids must be int64"),
    "head size strided": (lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous"),
    "head mismatch": (lambda a: {**a, "q": a["q"][:, :3]}, "does not match q's heads"),
    "too few blocks": (lambda a: {**a, "block_ids": a["block_ids"][:1]}, "block ids cannot hold 30 positions"),
    "block id out of range": (lambda a: {**a, "block_ids": a["block_ids"] + 100}, r"block id 10\d outside"),
    "negative start": (lambda a: {**a, "start": -1}, "negative start"),
}


@pytest.mark.parametrize("problem", list(BAD_INPUTS))
def test_kernel_refuses_bad_inputs_naming_the_problem(prefill_kernel: Callable[..., None], problem: str) -> None:
    change, message = BAD_INPUTS[problem]
    with pytest.raises(RuntimeError, match=message):
        kernel_prefill(prefill_kernel, change(chunk_inputs(4, 2, 64, 16, 10, 20)))


def test_kernel_refuses_a_head_size_off_16(prefill_kernel: Callable[..., None]) -> None:
    with pytest.raises(RuntimeError, match="head size 36 is not a multiple of 16"):
        kernel_prefill(prefill_kernel, chunk_inputs(4, 2, 36, 16, 0, 5))
