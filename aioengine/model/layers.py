"""Small building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP, the vocabulary embedding
(``Linear`` is in ``linear.py``)."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from aioengine.model.linear import Linear, RowParallelLinear
from aioengine.model.parallel import SINGLE, TensorParallel


class VocabEmbedding(nn.Module):
    """The token embedding; under tensor parallelism each rank holds ``vocab / tp`` rows (rank ``r`` the ids
    ``[r * rows, (r + 1) * rows)``), looks up the ids it holds, zeroes the others, and the ranks sum."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.rows = tp.partition(vocab_size, "vocab_size")
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))


def use_cpu_kernels(model: nn.Module, kernels: ModuleType | None) -> None:
    """Hands the C++ CPU kernels (``cpu_kernels.load()``; None: torch ops) to every layer that has a
    fused form: RMSNorm, rotary embedding, the gated MLP's activation, and Linear (its packed copy
    rebuilt in place). Each still takes the torch path for inputs the kernels do not cover (not
    float32, not CPU, partial rotary)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, GatedMLP, Linear)):
            module.kernels = kernels


def _fits_kernels(kernels: ModuleType | None, x: torch.Tensor) -> TypeGuard[ModuleType]:
    return kernels is not None and x.dtype == torch.float32 and x.device.type == "cpu"


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as HF transformers does (parity needs the same rounding)."""

    kernels: ModuleType | None = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fits_kernels(self.kernels, x) and self.weight.dtype == torch.float32:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Adds ``x`` into ``residual`` in place (the decoder's residual stream) and returns its norm: one
        pass on CPU (``add_rms_norm``), the same numbers as HF's ``residual + x`` followed by the norm."""
        if (
            _fits_kernels(self.kernels, x)
            and self.weight.dtype == torch.float32
            and residual.dtype == torch.float32
            and residual.is_contiguous()
        ):
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
        return self(residual.add_(x))


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """Rope settings across transformers 4.x (``rope_scaling``/``rope_theta``) and 5.x (``rope_parameters``)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def compute_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, the same numbers HF's rotary embedding uses."""
    params = _rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params["rope_theta"])
        # transformers 5 keeps it in rope_parameters, 4.x on the config itself
        partial = float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
        dim = int(head_dim * partial)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        from aioengine.errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: default, "
            + ", ".join(sorted(k for k in ROPE_INIT_FUNCTIONS if k != "dynamic"))
        )
    # transformers' functions read its own config object (ours is loaded on demand, only here)
    hf = hf_config.transformers_config() if hasattr(hf_config, "transformers_config") else hf_config
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a cos/sin table for every position up to ``max_positions``."""

    kernels: ModuleType | None = None

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self._inv_freq, self._scaling = compute_inv_freq(hf_config, head_dim)
        self.rotary_dim = self._inv_freq.numel() * 2
        self.max_positions = max_positions
        # Kept as buffers (not parameters): sleep level 2 saves and restores them by name.
        self.register_buffer("cos_cached", torch.empty(0), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0), persistent=False)
        if self.cos_cached.device.type != "meta":  # built on meta: the loader calls reset_buffers
            self.reset_buffers(self.cos_cached.device)

    def reset_buffers(self, device: torch.device) -> None:
        """(Re)computes the tables on ``device``; needed after the model was built on the meta device."""
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device="cpu"), self._inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached = (emb.cos() * self._scaling).to(device)
        self.sin_cached = (emb.sin() * self._scaling).to(device)

    def kernel_covers(self, head_dim: int) -> bool:
        """Whether ``kernels.rotary_inplace`` computes this rotary for heads of ``head_dim`` (float32 inputs
        given): kernels handed over, rotary over the whole head, float32 tables."""
        return self.kernels is not None and self.rotary_dim == head_dim and self.cos_cached.dtype == torch.float32

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D]; returns both rotated (the kernel rotates them in place)."""
        if _fits_kernels(self.kernels, q) and k.dtype == torch.float32 and self.kernel_covers(q.shape[-1]):
            self.kernels.rotary_inplace(q, k, positions, self.cos_cached, self.sin_cached)
            return q, k
        cos = self.cos_cached[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cached[positions].unsqueeze(1).to(q.dtype)
        return _apply(q, cos, sin, self.rotary_dim), _apply(k, cos, sin, self.rotary_dim)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim < x.shape[-1]:
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((_apply(x_rot, cos, sin, rotary_dim), x_pass), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one GEMM."""

    kernels: ModuleType | None = None

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            from aioengine.errors import UnsupportedModelError

            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; supported: silu")
        self.intermediate_size = tp.partition(intermediate_size, "intermediate_size")  # this rank's share
        self.gate_up_proj = Linear(hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(self.intermediate_size, hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if _fits_kernels(self.kernels, gate_up) and gate_up.dim() == 2:
            return self.down_proj(self.kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
