"""Specification of aioengine's row-block GEMM (``linear_row_blocks``, AVX-512 and AVX2 builds): ``x @ W.T`` read from
a Linear's oneDNN-reordered copy where that copy is in 64-row blocks (``row_blocks_equal`` confirms it first),
equal to ``F.linear`` at every row count, thread count, stride and bias, and refused where it does not fit.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import packed_linear, torch_threads


@pytest.fixture
def gemm_kernel(kernel: ModuleType) -> ModuleType:
    if not hasattr(kernel, "linear_row_blocks"):
        pytest.skip("the kernels were built without AVX-512 or AVX2: Linear runs oneDNN's GEMM")
    return kernel


class _Counting:
    """The kernels, counting the calls to the row-block GEMM."""

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels, self.gemm_calls = kernels, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernels, name)

    def linear_row_blocks(self, *args: Any) -> torch.Tensor:
        self.gemm_calls += 1
        return self.kernels.linear_row_blocks(*args)


def row_block_linear(kernels: Any, out_features: int, in_features: int) -> Any:
    """``packed_linear`` packed on one thread, so that its copy is in the 64-row blocks the GEMM reads. oneDNN
    picks the layout per thread count too (on an AVX2 host with 2 threads it lays 130 rows out in 16-row
    blocks, which the layer then leaves to oneDNN); the GEMM's sums do not depend on who packed the copy."""
    with torch_threads(1):
        layer = packed_linear(kernels, out_features, in_features)
    assert layer._row_blocks is not None
    return layer


@pytest.mark.parametrize(
    ("out_features", "in_features"), [(960, 576), (576, 1536), (100, 37), (7, 5), (130, 24), (64, 64), (70, 4500)]
)
@pytest.mark.parametrize("rows", [1, 7, 12, 13, 64, 1100])
def test_the_row_block_gemm_equals_f_linear(
    gemm_kernel: ModuleType, threads: int, out_features: int, in_features: int, rows: int
) -> None:
    """Rows off the 6-row tile and over the 1024-row chunk, columns and rows off the 64-row block (oneDNN
    pads both), a K the kernel sums in three chunks (4500: 1500 each), with and without a bias,
    from a view whose rows are further apart than its columns."""
    counting = _Counting(gemm_kernel)
    layer = row_block_linear(counting, out_features, in_features)
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, in_features + 3, generator=gen)
    for x in (wide[:, :in_features], wide[:, :in_features].contiguous()):
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-5)
    assert counting.gemm_calls == 2
    bias = torch.randn(out_features, generator=gen)
    address, floats, stride = layer._row_blocks
    torch.testing.assert_close(
        gemm_kernel.linear_row_blocks(wide[:, :in_features], address, floats, out_features, stride, bias),
        F.linear(wide[:, :in_features], layer.weight, bias),
        atol=1e-4,
        rtol=1e-5,
    )


def test_the_row_block_gemm_of_no_rows_is_empty(gemm_kernel: ModuleType) -> None:
    layer = packed_linear(gemm_kernel, 96, 64)
    assert layer._row_blocks is not None
    assert layer(torch.empty(0, 64)).shape == (0, 96)


def test_a_copy_the_check_does_not_confirm_runs_onednn(gemm_kernel: ModuleType) -> None:
    """oneDNN picks the copy's layout per CPU, shape and hint (64-row blocks, 16-row blocks, plain): where
    ``row_blocks_equal`` does not confirm 64-row blocks, the row-block GEMM must not read the copy, and the
    layer's output is oneDNN's, bit for bit."""

    class Unconfirmed(_Counting):
        @staticmethod
        def row_blocks_equal(*args: object) -> bool:
            return False

    kernels = Unconfirmed(gemm_kernel)
    layer = packed_linear(kernels, 130, 24)  # type: ignore[arg-type]
    assert layer._packed is not None and layer._row_blocks is None
    x = torch.randn(5, 24)
    onednn = torch.ops.mkldnn._linear_pointwise(x, layer._packed, None, "none", [], "")
    assert torch.equal(layer(x), onednn) and kernels.gemm_calls == 0


def test_row_blocks_equal_finds_a_copy_that_is_not_the_weight(gemm_kernel: ModuleType) -> None:
    layer = packed_linear(gemm_kernel, 100, 37)
    assert layer._row_blocks is not None
    address, floats, stride = layer._row_blocks
    weight = layer.weight.detach().clone()
    assert gemm_kernel.row_blocks_equal(weight, address, floats, 64, stride)
    weight[99, 36] += 1  # the last element: the padded block's last row, the padded stride's last column
    assert not gemm_kernel.row_blocks_equal(weight, address, floats, 64, stride)
    assert not gemm_kernel.row_blocks_equal(layer.weight.detach(), address, 2 * stride - 1, 64, stride)  # too small
    assert not gemm_kernel.row_blocks_equal(layer.weight.detach(), address, floats, 32, stride // 2)  # wrong block


@pytest.mark.parametrize("problem", ["dtype", "column stride", "too small", "stride", "bias", "no columns"])
def test_the_row_block_gemm_refuses_what_does_not_fit(gemm_kernel: ModuleType, problem: str) -> None:
    layer = packed_linear(gemm_kernel, 96, 64)
    assert layer._row_blocks is not None
    address, floats, stride = layer._row_blocks
    x, bias = torch.randn(4, 64), None
    if problem == "dtype":
        x = x.double()
    elif problem == "column stride":
        x = torch.randn(64, 4).t()
    elif problem == "too small":
        floats = 2 * stride - 1
    elif problem == "stride":
        stride = 64 * 64 - 1
    elif problem == "bias":
        bias = torch.randn(95)
    else:
        x = torch.randn(4, 0)
    with pytest.raises(RuntimeError, match="linear_row_blocks"):
        gemm_kernel.linear_row_blocks(x, address, floats, 96, stride, bias)


def _argmax_case(layer: Any, rows: int, case: str, gen: torch.Generator) -> torch.Tensor:
    """Inputs for ``case``. "ties": weight rows 3, 5, 70 and 71 equal and far the largest for positive x (a tie
    inside a block, across blocks, across the threads' shares); "nan": a row of NaN outputs only and one of
    NaN, +inf and -inf; "-inf": outputs of -inf and +inf only."""
    x = torch.randn(rows, layer.in_features, generator=gen)
    if case == "ties":
        top = 10 * torch.randn(layer.in_features, generator=gen).abs()
        with torch.no_grad():
            for r in (3, 5, 70, 71):
                layer.weight[r] = top
        layer.mark_packed_stale()
        with torch_threads(1):  # repacked as row_block_linear packed it
            layer.pack()
        x = x.abs()
    elif case == "nan":
        x[0, 0] = float("nan")
        x[1 % rows, 1] = float("inf")
    elif case == "-inf":
        x[:] = 0.0
        x[:, 0] = float("-inf")
    return x


@pytest.mark.parametrize("case", ["random", "ties", "nan", "-inf"])
@pytest.mark.parametrize(("out_features", "in_features"), [(1000, 96), (130, 24), (7, 5), (70, 4500)])
@pytest.mark.parametrize("rows", [1, 13, 64, 1100])
def test_the_fused_argmax_is_argmax_rows_of_the_gemm(
    gemm_kernel: ModuleType, threads: int, out_features: int, in_features: int, rows: int, case: str
) -> None:
    """``linear_row_blocks_argmax`` (greedy over an lm_head, the logits never written) answers what
    ``argmax_rows`` answers on ``linear_row_blocks``' output, first maximum and NaN rule included, at row
    counts over the 6-row tile, split in halves over 2 threads and over the 1024-row chunk."""
    if case == "ties" and out_features < 72:
        pytest.skip("the tie needs 72 output rows")
    layer = row_block_linear(gemm_kernel, out_features, in_features)
    gen = torch.Generator().manual_seed(rows + out_features)
    x = _argmax_case(layer, rows, case, gen)
    copy = layer.row_block_weight()
    assert copy is not None
    address, floats, _, stride = copy
    answers = []
    for bias in (None, torch.randn(out_features, generator=gen)):
        logits = gemm_kernel.linear_row_blocks(x, address, floats, out_features, stride, bias)
        fused = gemm_kernel.linear_row_blocks_argmax(x, address, floats, out_features, stride, bias)
        assert fused.dtype == torch.int64 and fused.shape == (rows,)
        assert torch.equal(fused, gemm_kernel.argmax_rows(logits))
        answers.append(fused)
    if case == "ties":
        assert answers[0].eq(3).all()  # rows 3, 5, 70 and 71 tie without a bias: the first wins
    if case == "nan":
        assert answers[0][0] == 0  # nothing but NaN: 0, as argmax_rows


def test_the_fused_argmax_refuses_what_does_not_fit(gemm_kernel: ModuleType) -> None:
    layer = packed_linear(gemm_kernel, 96, 64)
    assert layer._row_blocks is not None
    address, floats, stride = layer._row_blocks
    with pytest.raises(RuntimeError, match="linear_row_blocks_argmax: the weight copy"):
        gemm_kernel.linear_row_blocks_argmax(torch.randn(4, 64), address, 2 * stride - 1, 96, stride, None)
    with pytest.raises(RuntimeError, match="linear_row_blocks_argmax: x must be"):
        gemm_kernel.linear_row_blocks_argmax(torch.randn(4, 64).double(), address, floats, 96, stride, None)
