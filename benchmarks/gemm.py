"""The linear layers' GEMMs alone, per row count: ``F.linear``, oneDNN from its reordered copy, and
aioengine's row-block GEMM reading that same copy (what ``Linear`` runs on CPU).

    python -m benchmarks gemm [--model real|small|tiny] [--rows 1,4,8,16,32,64,128,512,1024] [--repeats 5]

The weights have a checkpoint's shapes (q/k/v fused, o, gate/up fused, down; the lm_head apart) and are
random, one set per layer of the model, so they do not stay in the caches from one call to the next,
as in a forward. Packing is for ``scheduler.max_num_seqs`` rows, as the engine packs. For each row count
every path runs over all layers ``--repeats`` times (oneDNN and the row-block GEMM alternating, F.linear
after them), and the best run counts.
Reported as GFLOP/s, with the row-block GEMM over oneDNN's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from aioengine.config import SchedulerConfig
from aioengine.model import cpu_kernels
from aioengine.model.linear import Linear, cpu_prepack_supported
from aioengine.model.packing import set_weight_prepack
from benchmarks.ceiling import ModelShape
from benchmarks.workload import MODELS, checkpoint

PATHS = ("F.linear", "oneDNN", "row blocks")


def layer_shapes(shape: ModelShape) -> list[tuple[int, int]]:
    """``(out, in)`` of one decoder layer's projections as aioengine fuses them."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    hidden, inter = shape.hidden_size, shape.intermediate_size
    return [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]


def packed(weight: torch.Tensor, kernels: object, hint: int) -> Linear:
    """A served ``Linear`` holding ``weight`` [out, in], packed for ``hint`` rows, on ``kernels`` (None: oneDNN)."""
    layer = Linear(weight.shape[1], weight.shape[0], bias=False).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    layer.kernels = kernels  # type: ignore[assignment]
    set_weight_prepack(layer, hint)
    return layer


def calls(layers: list[Linear], rows: int) -> dict[str, Callable[[], None]]:
    """One call per path over every layer, inputs made once."""
    xs = {layer.in_features: torch.randn(rows, layer.in_features) for layer in layers}
    onednn = torch.ops.mkldnn._linear_pointwise

    def f_linear() -> None:
        for layer in layers:
            F.linear(xs[layer.in_features], layer.weight)

    def one_dnn() -> None:
        for layer in layers:
            onednn(xs[layer.in_features], layer._packed, None, "none", [], "")

    def row_blocks() -> None:
        for layer in layers:
            layer(xs[layer.in_features])

    out = {"F.linear": f_linear, "oneDNN": one_dnn}
    if all(layer._row_blocks is not None for layer in layers):
        out["row blocks"] = row_blocks
    return out


def best_rates(layers: list[Linear], rows: int, repeats: int) -> dict[str, float]:
    """GFLOP/s of each path's best run."""
    flops = sum(2 * rows * layer.in_features * layer.out_features for layer in layers)
    paths = calls(layers, rows)
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    # oneDNN and the row-block GEMM alternate; F.linear runs apart, after them: MKL's threads spin on
    # after a call and slow whatever runs next. Each round starts with the next path in turn: whichever ran
    # first in every round ran 3-10% slower at 1-16 rows on a Zen 4 host, which a fixed order charged to one.
    for group in ([n for n in paths if n != "F.linear"], ["F.linear"]):
        for name in group:
            paths[name]()  # untimed: first touch of the inputs and outputs
        for round_ in range(repeats):
            turn = round_ % len(group)
            for name in group[turn:] + group[:turn]:
                start = time.perf_counter()
                paths[name]()
                seconds[name].append(time.perf_counter() - start)
    return {name: flops / min(s) / 1e9 for name, s in seconds.items()}


def table(title: str, rates: dict[int, dict[str, float]]) -> str:
    lines = [
        f"**{title}** (GFLOP/s, best of the repeats)",
        "",
        "| rows | " + " | ".join(PATHS) + " | row blocks / oneDNN |",
        "|---:|" + "---:|" * (len(PATHS) + 1),
    ]
    for rows, by_path in rates.items():
        cells = [f"{by_path[p]:.1f}" if p in by_path else "-" for p in PATHS]
        ratio = f"{by_path['row blocks'] / by_path['oneDNN']:.2f}x" if "row blocks" in by_path else "-"
        lines.append(f"| {rows} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="real")
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,512,1024", help="comma separated row counts")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not cpu_prepack_supported(torch.device("cpu"), torch.float32):
        raise SystemExit("this torch has no oneDNN linear: there is nothing to compare")
    kernels = cpu_kernels.load()
    if kernels is None or not hasattr(kernels, "linear_row_blocks"):
        print(
            "the CPU kernels have no row-block GEMM here (no build, or neither AVX-512 nor AVX2): "
            "oneDNN and F.linear only"
        )
    shape = ModelShape.from_config(checkpoint(args.model))
    hint = SchedulerConfig().max_num_seqs
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    with torch.inference_mode():
        shapes = layer_shapes(shape) * shape.num_layers
        layers = [packed(torch.randn(o, i) * 0.02, kernels, hint) for o, i in shapes]
        head = [packed(torch.randn(shape.vocab_size, shape.hidden_size) * 0.02, kernels, hint)]
        print(f"{args.model}: {shape.num_layers} layers of {layer_shapes(shape)}, lm_head {shape.vocab_size}x"
              f"{shape.hidden_size}; packed for {hint} rows; {torch.get_num_threads()} torch threads\n")  # fmt: skip
        print(table("decoder layers", {r: best_rates(layers, r, args.repeats) for r in rows}) + "\n")
        print(table("lm_head", {r: best_rates(head, r, args.repeats) for r in rows}))


if __name__ == "__main__":
    main()
