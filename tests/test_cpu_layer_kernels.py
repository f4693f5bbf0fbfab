"""Specification of the fused elementwise CPU kernels (``rms_norm``, ``add_rms_norm``, ``rotary_inplace``,
``silu_and_mul``) and of the layers that use them: each equals the torch path it replaces, which stays for
what the kernels do not cover.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from aioengine.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, use_cpu_kernels

TOL = {"atol": 1e-5, "rtol": 1e-5}


def with_and_without(kernels: ModuleType, layer: torch.nn.Module, *args: torch.Tensor) -> tuple:
    """The layer's output on copies of ``args`` through the kernels, then through torch ops."""
    use_cpu_kernels(layer, kernels)
    fused = layer(*(a.clone() for a in args))
    use_cpu_kernels(layer, None)
    return fused, layer(*(a.clone() for a in args))


@pytest.mark.parametrize("shape", [(64, 256), (3, 5, 256), (1, 256)])
def test_rms_norm_equals_the_torch_path(kernel: ModuleType, shape: tuple[int, ...]) -> None:
    norm = RMSNorm(256, 1e-6)
    norm.weight.data = torch.randn(256)
    x = torch.randn(*shape) * 3
    fused, plain = with_and_without(kernel, norm, x)
    torch.testing.assert_close(fused, plain, **TOL)


def test_rms_norm_of_a_strided_view_reads_the_view(kernel: ModuleType) -> None:
    norm = RMSNorm(64, 1e-6)  # Qwen3's q_norm runs on heads sliced out of the fused qkv output
    qkv = torch.randn(7, 3, 128)
    fused, plain = with_and_without(kernel, norm, qkv[:, :, :64])
    torch.testing.assert_close(fused, plain, **TOL)


@pytest.mark.parametrize("shape", [(64, 256), (3, 5, 256), (1, 256)])
def test_add_and_norm_adds_into_the_residual_and_equals_the_torch_path(
    kernel: ModuleType, shape: tuple[int, ...]
) -> None:
    norm = RMSNorm(256, 1e-6)
    norm.weight.data = torch.randn(256)
    x, residual = torch.randn(*shape), torch.randn(*shape) * 3
    results = []
    for kernels in (kernel, None):
        use_cpu_kernels(norm, kernels)
        stream = residual.clone()
        results.append((norm.add_and_norm(x, stream), stream))
    (fused, fused_stream), (plain, plain_stream) = results
    torch.testing.assert_close(fused_stream, residual + x, atol=0, rtol=0)  # the add is exact, as HF's
    torch.testing.assert_close(plain_stream, residual + x, atol=0, rtol=0)
    torch.testing.assert_close(fused, plain, **TOL)
    torch.testing.assert_close(plain, norm(residual + x), atol=0, rtol=0)


def test_add_and_norm_takes_a_strided_input(kernel: ModuleType) -> None:
    norm = RMSNorm(64, 1e-6)
    use_cpu_kernels(norm, kernel)
    wide, residual = torch.randn(7, 128), torch.randn(7, 64)
    out = norm.add_and_norm(wide[:, :64], residual.clone())
    torch.testing.assert_close(out, norm(residual + wide[:, :64]), **TOL)


def rotary(head_dim: int = 64, partial: float = 1.0) -> RotaryEmbedding:
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_theta=10000.0,
                      partial_rotary_factor=partial)  # fmt: skip
    return RotaryEmbedding(cfg, head_dim, max_positions=300)


@pytest.mark.parametrize("head_dim", [64, 32])
def test_rotary_in_place_on_views_of_the_qkv_output_equals_the_torch_path(kernel: ModuleType, head_dim: int) -> None:
    rope = rotary(head_dim)
    t, heads, kv_heads = 9, 4, 2
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim)
    positions = torch.tensor([0, 1, 2, 15, 16, 17, 100, 250, 299])

    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = x.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim)

    use_cpu_kernels(rope, None)
    want_q, want_k = rope(positions, *split(qkv.clone()))
    use_cpu_kernels(rope, kernel)
    buffer = qkv.clone()
    got_q, got_k = rope(positions, *split(buffer))
    torch.testing.assert_close(got_q, want_q, **TOL)
    torch.testing.assert_close(got_k, want_k, **TOL)
    torch.testing.assert_close(buffer[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:],
                               atol=0, rtol=0)  # v untouched  # fmt: skip


def test_partial_rotary_takes_the_torch_path(kernel: ModuleType) -> None:
    rope = rotary(64, partial=0.5)
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    positions = torch.tensor([1, 2, 3])
    fused, plain = with_and_without(kernel, rope, positions, q, k)
    torch.testing.assert_close(fused, plain, **TOL)
    torch.testing.assert_close(fused[0][..., 32:], q[..., 32:], atol=0, rtol=0)  # the pass-through half


def test_rotary_refuses_a_position_past_its_table(kernel: ModuleType) -> None:
    rope = rotary()
    use_cpu_kernels(rope, kernel)
    with pytest.raises(RuntimeError, match="position 300 outside the table"):
        rope(torch.tensor([300]), torch.randn(1, 4, 64), torch.randn(1, 2, 64))


def test_silu_and_mul_equals_the_torch_mlp_activation(kernel: ModuleType) -> None:
    gate_up = torch.randn(33, 2 * 100) * 6
    gate_up[0, :12] = torch.tensor([-100.0, -88, -20, -1e-3, 0, 1e-3, 20, 88, 100, float("inf"), -float("inf"), 3])
    want = F.silu(gate_up[:, :100]) * gate_up[:, 100:]
    torch.testing.assert_close(kernel.silu_and_mul(gate_up), want, **TOL, equal_nan=True)


def test_gated_mlp_equals_the_torch_path(kernel: ModuleType) -> None:
    mlp = GatedMLP(64, 96, "silu")
    fused, plain = with_and_without(kernel, mlp, torch.randn(10, 64))
    torch.testing.assert_close(fused, plain, **TOL)


def test_layers_take_the_torch_path_for_float64(kernel: ModuleType) -> None:
    norm = RMSNorm(16, 1e-6).double()
    use_cpu_kernels(norm, kernel)
    x = torch.randn(4, 16, dtype=torch.float64)
    assert norm(x).dtype == torch.float64  # the kernel is float32 only; it would have raised
