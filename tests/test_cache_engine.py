"""Specification of the CacheEngine: the paged KV cache's layout, size, and block moves (swap, copy)."""

from __future__ import annotations

import pytest
import torch

from aioengine.worker.cache_engine import CacheEngine

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 3, 2, 8, 4


def make_cache(num_blocks: int = 10, num_host_blocks: int = 0, dtype: torch.dtype = torch.float32) -> CacheEngine:
    return CacheEngine(LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, num_blocks, dtype, torch.device("cpu"), num_host_blocks)


def filled(cache: CacheEngine, seed: int = 0) -> CacheEngine:
    """Every block of both caches gets distinct random values, so a wrong block is always visible."""
    gen = torch.Generator().manual_seed(seed)
    for layer in [*cache.device_cache, *cache.host_cache]:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    return cache


def snapshot(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [layer.clone() for layer in layers]


def test_each_layer_has_one_tensor_shaped_kv_blocks_tokens_heads_dim() -> None:
    cache = make_cache(num_blocks=10)
    assert len(cache.device_cache) == LAYERS
    for layer in cache.device_cache:
        assert tuple(layer.shape) == (2, 10, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
        assert layer.dtype == torch.float32


def test_layers_do_not_share_memory() -> None:
    cache = make_cache()
    pointers = {layer.data_ptr() for layer in cache.device_cache}
    assert len(pointers) == LAYERS


@pytest.mark.parametrize(("dtype", "dtype_size"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_cache_block_size_is_layers_times_k_and_v_times_tokens_heads_dim_bytes(
    dtype: torch.dtype, dtype_size: int
) -> None:
    got = CacheEngine.get_cache_block_size(num_layers=4, block_size=16, num_kv_heads=2, head_size=64, dtype=dtype)
    assert got == 4 * 2 * 16 * 2 * 64 * dtype_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allocated_bytes_are_num_blocks_times_block_size(dtype: torch.dtype) -> None:
    cache = make_cache(num_blocks=7, dtype=dtype)
    assert cache.device_cache[0].dtype == dtype
    block = CacheEngine.get_cache_block_size(LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, dtype)
    assert cache.nbytes == 7 * block


def test_swap_out_copies_chosen_blocks_to_host_and_nothing_else() -> None:
    cache = filled(make_cache(num_blocks=10, num_host_blocks=6))
    device_before, host_before = snapshot(cache.device_cache), snapshot(cache.host_cache)

    cache.swap_out({3: 0, 7: 5})

    for layer, (dev, host, dev0, host0) in enumerate(
        zip(cache.device_cache, cache.host_cache, device_before, host_before, strict=True)
    ):
        assert torch.equal(host[:, 0], dev0[:, 3]), layer
        assert torch.equal(host[:, 5], dev0[:, 7]), layer
        assert torch.equal(host[:, 1:5], host0[:, 1:5]), layer
        assert torch.equal(dev, dev0), layer  # the source is read, not moved


def test_swap_out_then_swap_in_round_trips_blocks() -> None:
    cache = filled(make_cache(num_blocks=10, num_host_blocks=6))
    original = snapshot(cache.device_cache)

    cache.swap_out({3: 0, 7: 5})
    for layer in cache.device_cache:  # the device blocks are reused by someone else meanwhile
        layer[:, [3, 7]] = -1.0
    cache.swap_in({0: 1, 5: 8})

    for layer, (dev, dev0) in enumerate(zip(cache.device_cache, original, strict=True)):
        assert torch.equal(dev[:, 1], dev0[:, 3]), layer
        assert torch.equal(dev[:, 8], dev0[:, 7]), layer
        untouched = [b for b in range(10) if b not in (1, 3, 7, 8)]
        assert torch.equal(dev[:, untouched], dev0[:, untouched]), layer


def test_copy_copies_a_block_to_every_destination_in_every_layer() -> None:
    cache = filled(make_cache(num_blocks=10))
    before = snapshot(cache.device_cache)

    cache.copy({2: [5, 9], 4: [0]})

    for layer, (dev, dev0) in enumerate(zip(cache.device_cache, before, strict=True)):
        assert torch.equal(dev[:, 5], dev0[:, 2]), layer
        assert torch.equal(dev[:, 9], dev0[:, 2]), layer
        assert torch.equal(dev[:, 0], dev0[:, 4]), layer
        untouched = [1, 2, 3, 4, 6, 7, 8]
        assert torch.equal(dev[:, untouched], dev0[:, untouched]), layer


@pytest.mark.parametrize("direction", ["swap_in", "swap_out"])
def test_swap_without_host_cache_raises_a_clear_error(direction: str) -> None:
    cache = make_cache(num_blocks=10, num_host_blocks=0)
    with pytest.raises(RuntimeError, match="num_host_blocks"):
        getattr(cache, direction)({0: 1})


def test_empty_block_maps_are_a_no_op() -> None:
    cache = filled(make_cache(num_blocks=4))
    before = snapshot(cache.device_cache)
    cache.swap_in({})
    cache.swap_out({})
    cache.copy({})
    assert all(torch.equal(a, b) for a, b in zip(cache.device_cache, before, strict=True))
