"""The FLOP ceiling: the tokens/s a system would reach if the workload's FLOPs ran at fp32 GEMM peak.

Two halves, both from this run:

1. Peak: torch's fp32 GEMM (``F.linear``, as the models call it) on a few large shapes, best of a few
   runs each, on torch's current threads. The best shape's FLOP/s is the peak.
2. Work: the workload's FLOPs for the checkpoint's shape (read from its config.json). Each request of
   prompt length L and n output tokens processes T = L + n - 1 tokens (the prompt, then every output
   token but the last as a decode input). Per token, 2 FLOPs per weight of every layer's projections
   (q, k, v, o, gate, up, down); per sampled row (n per request: the last prompt token and every
   decode step), 2 * hidden * vocab for the lm_head; and, reported apart, attention: QK^T and PV at
   4 * heads * head_dim FLOPs per (query, key) pair per layer, causal, so the token at position p
   (0-based) attends to p + 1 keys and a request costs T (T + 1) / 2 pairs per layer.

ceiling tokens/s = output tokens / (FLOPs / peak), with and without attention. Norms, rotary, the
activation, sampling and the embedding gather are left out: they are memory-bound and small. A system's
share of the ceiling is its tokens/s over the ceiling's (with attention).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.workload import BenchRequest, output_tokens

GEMM_SHAPES: tuple[tuple[int, int, int], ...] = ((2048, 2048, 2048), (1024, 4096, 4096), (4096, 1024, 4096))
"""(tokens, in features, out features) of the peak's GEMMs: large, square-ish, as the brief's 2048^3."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the FLOP count needs of a decoder (Llama and Qwen2 alike)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, checkpoint: Path) -> ModelShape:
        """From ``checkpoint/config.json`` (HF names); head_dim defaults to hidden / heads."""
        config: dict[str, Any] = json.loads((checkpoint / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            vocab_size=int(config["vocab_size"]),
        )

    @property
    def layer_weights(self) -> int:
        """Weights of one layer's projections: q and o (heads), k and v (KV heads), gate, up and down."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * self.intermediate_size

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """KV cache bytes one token takes across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class WorkloadFlops:
    """The workload's FLOPs, by kind."""

    linear: float
    """Every layer's projections over every processed token."""
    lm_head: float
    """One logits row per output token."""
    attention: float
    """QK^T and PV, causal."""
    output_tokens: int
    processed_tokens: int
    """Prompt tokens plus every output token but each request's last."""

    @property
    def without_attention(self) -> float:
        return self.linear + self.lm_head

    @property
    def total(self) -> float:
        return self.linear + self.lm_head + self.attention


def workload_flops(shape: ModelShape, reqs: list[BenchRequest]) -> WorkloadFlops:
    """The FLOPs of ``reqs`` on ``shape`` (the module docstring says what is counted)."""
    linear = lm_head = attention = 0
    processed = 0
    for r in reqs:
        tokens = len(r.prompt) + r.max_tokens - 1
        processed += tokens
        linear += 2 * shape.layer_weights * shape.num_layers * tokens
        lm_head += 2 * shape.hidden_size * shape.vocab_size * r.max_tokens
        attention += 4 * shape.num_heads * shape.head_dim * shape.num_layers * tokens * (tokens + 1) // 2
    return WorkloadFlops(float(linear), float(lm_head), float(attention), output_tokens(reqs), processed)


@dataclass(frozen=True, slots=True)
class GemmPeak:
    """fp32 GEMM FLOP/s measured here: the best shape's, and every shape's best run."""

    flops_per_s: float
    shape: tuple[int, int, int]
    per_shape: dict[str, float]
    threads: int
    others_load: float | None = None


def measure_gemm_peak(shapes: tuple[tuple[int, int, int], ...] = GEMM_SHAPES, runs: int = 5) -> GemmPeak:
    """Best of ``runs`` timed GEMMs per shape and path (after one untimed), on torch's threads.

    Up to three paths, the fastest counts: ``F.linear`` (MKL or OpenBLAS) and, where torch has oneDNN,
    its linear from a reordered weight and aioengine's row-block GEMM reading that copy (what ``Linear``
    runs on CPU, where the kernels have it; MKL takes a generic path on AMD CPUs, so F.linear alone can
    sit well below what the machine does)."""
    import torch
    import torch.nn.functional as F

    from aioengine.model import cpu_kernels
    from aioengine.model.linear import cpu_prepack_supported
    from benchmarks.cpu_load import CpuLoad
    from benchmarks.gemm import packed as packed_linear  # gemm imports this module: imported here

    onednn = cpu_prepack_supported(torch.device("cpu"), torch.float32)
    kernels = cpu_kernels.load() if onednn else None
    per_shape: dict[str, float] = {}
    best: tuple[float, tuple[int, int, int]] = (0.0, shapes[0])
    with torch.inference_mode(), CpuLoad() as load:
        for m, k, n in shapes:
            x, w = torch.randn(m, k), torch.randn(n, k)
            paths = {"F.linear": lambda x=x, w=w: F.linear(x, w)}
            if onednn:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
                paths["oneDNN"] = lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                layer = packed_linear(w, kernels, m)
                if layer._row_blocks is not None:
                    paths["row blocks"] = lambda x=x, layer=layer: layer(x)
            for name, gemm in paths.items():
                gemm()
                seconds = []
                for _ in range(runs):
                    start = time.perf_counter()
                    gemm()
                    seconds.append(time.perf_counter() - start)
                rate = 2 * m * k * n / min(seconds)
                per_shape[f"{m}x{k}x{n} {name}"] = rate
                best = max(best, (rate, (m, k, n)))
    return GemmPeak(best[0], best[1], per_shape, torch.get_num_threads(), load.others)


def measure_gemm_peak_apart() -> GemmPeak:
    """``measure_gemm_peak`` in a fresh Python process, so that the benchmark's own process (where aioengine
    then runs) has never run its large GEMMs: after them on the main thread, aioengine's offline runs in the
    same process were 10-20% slower here (131-150 against 159-177 tok/s on the real model, alternated),
    while a system in its own process (vLLM) is untouched."""
    code = (
        "import dataclasses, json; from benchmarks.ceiling import measure_gemm_peak; "
        "print(json.dumps(dataclasses.asdict(measure_gemm_peak())))"
    )
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    fields = json.loads(out.stdout.strip().splitlines()[-1])
    return GemmPeak(**{**fields, "shape": tuple(fields["shape"])})


@dataclass(frozen=True, slots=True)
class Ceiling:
    """The workload's FLOPs over the measured peak, as output tokens/s."""

    peak: GemmPeak
    flops: WorkloadFlops

    @property
    def tokens_per_s(self) -> float:
        """With attention: the figure a system's share is taken of."""
        return self.flops.output_tokens * self.peak.flops_per_s / self.flops.total

    @property
    def tokens_per_s_without_attention(self) -> float:
        return self.flops.output_tokens * self.peak.flops_per_s / self.flops.without_attention

    def share(self, tokens_per_s: float | None) -> float | None:
        """``tokens_per_s`` as a share of the ceiling (with attention)."""
        return None if tokens_per_s is None else tokens_per_s / self.tokens_per_s

    def describe(self) -> str:
        """One markdown line for the report."""
        f, p = self.flops, self.peak
        gflop = 1e9
        return (
            f"**FLOP ceiling**: {self.tokens_per_s:.0f} output tokens/s with attention, "
            f"{self.tokens_per_s_without_attention:.0f} without: the workload's {f.total / gflop:.1f} GFLOP "
            f"(projections {f.linear / gflop:.1f}, lm_head {f.lm_head / gflop:.1f}, attention "
            f"{f.attention / gflop:.1f}; {f.processed_tokens} tokens processed) at the fp32 GEMM peak "
            f"measured here, {p.flops_per_s / gflop:.1f} GFLOP/s ({'x'.join(map(str, p.shape))}, "
            f"{p.threads} torch threads)."
        )


def ceiling(checkpoint: Path, reqs: list[BenchRequest], peak: GemmPeak | None = None) -> Ceiling:
    """The ceiling of ``reqs`` on ``checkpoint``'s shape; measures the peak unless given."""
    return Ceiling(peak or measure_gemm_peak(), workload_flops(ModelShape.from_config(checkpoint), reqs))
