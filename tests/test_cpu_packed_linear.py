"""Specification of oneDNN-packed ``Linear`` weights (``device.cpu_weight_prepack``, on by default): the
layer runs from a reordered copy of its weight and gives what ``F.linear`` gives; a weight write rewrites
the copy in place (``pack_rows``), into a layout found by a probe, never assumed; and in AVX-512 and AVX2
builds the row-block GEMM (``linear_row_blocks``, ``test_cpu_row_block_gemm.py``) reads that copy once a check
confirmed its layout. The engine-level checks (HF parity with the speed paths on and off, swaps, sleep) are in
``test_cpu_kernels.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from aioengine.model.linear import Linear, cpu_prepack_supported
from aioengine.model.onednn_layout import row_block_layout
from aioengine.model.packing import dense_parameters, set_weight_prepack
from aioengine.testing import build_checkpoint
from aioengine.worker.model_runner import ModelRunner
from aioengine.worker.weights import apply_weights, describe_source
from tests.conftest import engine_config
from tests.helpers import packed_linear, torch_threads


# ---- oneDNN-packed Linear ----------------------------------------------------------------------------
@pytest.fixture
def linear() -> Linear:
    assert cpu_prepack_supported(torch.device("cpu"), torch.float32), "torch's CPU builds have oneDNN"
    torch.manual_seed(0)
    layer = Linear(64, 96).requires_grad_(False)  # as served; a weight that wants gradients runs F.linear
    assert set_weight_prepack(layer, 8) == layer.weight.nbytes
    return layer


def test_a_weight_that_wants_gradients_runs_f_linear(linear: Linear) -> None:
    linear.requires_grad_(True)
    out = linear(torch.randn(4, 64))
    assert out.requires_grad  # the oneDNN op has no autograd; F.linear keeps training correct


def assert_runs_packed(layer: Linear, x: torch.Tensor) -> None:
    """The layer gives F.linear of its current weight, from a packed copy (rebuilt if it was stale); up to
    float32 rounding, which differs with the order of the sums (outputs here are up to ~50 in size)."""
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.dense_weight(), layer.bias), atol=1e-4, rtol=1e-5)
    assert layer._packed is not None and layer.prepack_hint is not None


@pytest.mark.parametrize("shape", [(1, 64), (8, 64), (50, 64), (3, 5, 64)])
def test_packed_linear_matches_f_linear(linear: Linear, shape: tuple[int, ...]) -> None:
    assert_runs_packed(linear, torch.randn(*shape))


def test_packed_linear_runs_from_its_copy_until_it_is_dropped(linear: Linear) -> None:
    # A write through .data bumps no version counter: unseen until the copy is dropped or marked stale
    # (weights_changed marks every copy stale).
    x = torch.randn(4, 64)
    before = linear(x)
    linear.weight.data.mul_(2)
    torch.testing.assert_close(linear(x), before, atol=0, rtol=0)
    linear.drop_packed()
    assert linear._packed is None
    assert_runs_packed(linear, x)


def test_packed_linear_follows_an_in_place_copy_into_its_weight(linear: Linear) -> None:
    linear(torch.randn(4, 64))
    with torch.no_grad():
        linear.weight.copy_(torch.randn_like(linear.weight))
    assert_runs_packed(linear, torch.randn(4, 64))


def test_packed_linear_follows_a_swap_of_its_weight_storage(linear: Linear) -> None:
    linear(torch.randn(4, 64))
    linear.weight.data = torch.randn_like(linear.weight)
    assert_runs_packed(linear, torch.randn(4, 64))


def test_weights_changed_marks_every_packed_copy_stale_and_the_next_forward_rebuilds_them(llama_ckpt: Path) -> None:
    runner = ModelRunner(engine_config(llama_ckpt), torch.device("cpu"))
    runner.load_model(str(llama_ckpt))
    assert runner.model is not None
    layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.packed_current() for m in layers)
    runner.model.weights_changed()
    assert not any(m.packed_current() for m in layers)
    runner.profile_run()  # one whole forward
    assert all(m.packed_current() for m in layers)


@pytest.mark.parametrize("keep_plain", [True, False], ids=["plain kept", "plain released"])
def test_a_weight_write_packs_each_layer_in_place_as_its_weight_is_completed(
    kernel: ModuleType, llama_ckpt: Path, keep_plain: bool
) -> None:
    def loaded(keep_plain: bool) -> ModelRunner:
        runner = ModelRunner(engine_config(llama_ckpt, device={"cpu_keep_plain_weights": keep_plain}), cpu)
        runner.load_model(str(llama_ckpt))
        return runner

    cpu = torch.device("cpu")
    runner, kept = loaded(keep_plain), loaded(keep_plain=True)
    assert runner.model is not None and kept.model is not None
    layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
    # Every layer owns its weight here (the checkpoint's LM head is not tied): released unless kept.
    assert [m.plain_released for m in layers] == [not keep_plain] * len(layers)
    old_copies = [m._packed for m in layers]
    gen = torch.Generator().manual_seed(1)
    source = {
        n: torch.randn(t.shape, generator=gen) * 0.02 for n, t in load_file(llama_ckpt / "model.safetensors").items()
    }
    apply_weights(runner.model, describe_source(source))
    apply_weights(kept.model, describe_source(source))
    # Packed during the write (q, k and v fill one fused weight, gate and up another): nothing left to pack,
    # and every copy was rewritten where it was (no fresh memory).
    assert all(m._packed is not None and m.packed_current() for m in layers)
    assert all(m._packed is old for m, old in zip(layers, old_copies, strict=True))
    assert runner.prepack_weights() == 0
    assert all((m._row_blocks is not None) == hasattr(kernel, "linear_row_blocks") for m in layers)
    plain = dict(kept.model.named_parameters())
    for name, values in dense_parameters(runner.model).items():
        assert torch.equal(values, plain[name]), name  # a released weight's copy holds what the plain one got
    for layer in layers:
        assert layer._packed is not None
        assert torch.equal(layer._packed.to_dense(), layer.dense_weight())
        assert_runs_packed(layer, torch.randn(3, layer.in_features, generator=gen))


# ---- the copy as the weight's one store (cpu_keep_plain_weights off) ------------------------------------
def released_linear(kernel: ModuleType, out_features: int = 96, in_features: int = 64) -> Linear:
    layer = packed_linear(kernel, out_features, in_features)
    layer.keep_plain = False
    layer.drop_packed()
    layer.pack()  # a fresh copy, made with the plain weight released
    return layer


def test_a_released_weight_lives_in_its_copy_alone_and_fails_loudly_when_read(kernel: ModuleType) -> None:
    torch.manual_seed(0)
    layer = packed_linear(kernel, 96, 64)
    values = layer.weight.detach().clone()
    layer.keep_plain = False
    layer.drop_packed()
    assert layer.pack() == values.nbytes
    assert layer.plain_released and layer.weight.device.type == "meta"
    assert tuple(layer.weight.shape) == (96, 64) and layer.weight.dtype == torch.float32
    assert torch.equal(layer.dense_weight(), values)
    assert_runs_packed(layer, torch.randn(5, 64))
    with pytest.raises(NotImplementedError):
        layer.weight.cpu()  # no stale or made-up values: a reader that skips dense_weight() fails


def test_rows_written_into_a_released_weight_land_in_its_copy_whatever_their_dtype_or_layout(
    kernel: ModuleType,
) -> None:
    layer = released_linear(kernel)
    before = layer.dense_weight()
    rows = torch.randn(64, 20).t()  # [20, 64], not contiguous
    halves = torch.randn(30, 64).bfloat16()
    piece = layer.weight.narrow(0, 10, 20)
    assert layer.write_rows(10, piece, rows) and layer.write_rows(50, layer.weight.narrow(0, 50, 30), halves)
    expected = before.clone()
    expected[10:30], expected[50:80] = rows, halves.float()
    layer.mark_packed_stale()
    assert layer.pack() and torch.equal(layer.dense_weight(), expected)  # untouched rows keep their values
    assert_runs_packed(layer, torch.randn(4, 64))
    with pytest.raises(ValueError, match="src has shape"):
        layer.write_rows(0, piece, torch.randn(3, 64))


@pytest.mark.parametrize("keep_values", [True, False])
def test_dropping_a_released_copy_brings_the_plain_weight_back(kernel: ModuleType, keep_values: bool) -> None:
    layer = released_linear(kernel)
    values = layer.dense_weight()
    layer.drop_packed(keep_values)
    assert not layer.plain_released and layer._packed is None and layer.weight.device.type == "cpu"
    assert tuple(layer.weight.shape) == (96, 64) and not layer.weight.requires_grad
    if keep_values:
        assert torch.equal(layer.weight, values)
        assert_runs_packed(layer, torch.randn(4, 64))  # packed again from the plain weight (and released)
        assert layer.plain_released


def test_a_weight_another_module_holds_too_stays_plain(kernel: ModuleType, tmp_path: Path) -> None:
    """A tied LM head computes from the embedding's table, which the embedding reads by rows."""
    ckpt = build_checkpoint(tmp_path / "tied", "qwen2", tie_word_embeddings=True)
    runner = ModelRunner(engine_config(ckpt), torch.device("cpu"))
    runner.load_model(str(ckpt))
    assert runner.model is not None
    head = runner.model.lm_head
    assert head.weight is runner.model.model.embed_tokens.weight and not head.plain_released
    others = [m for m in runner.model.modules() if isinstance(m, Linear) and m is not head]
    assert others and all(m.plain_released for m in others)


# ---- in-place repacking (pack_rows) ------------------------------------------------------------------
class _WithoutGemm:
    """The kernels as a build without AVX-512 or AVX2 has them: no row-block GEMM, so a copy is reordered for the
    layer's own hint."""

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels

    def __getattr__(self, name: str) -> Any:
        if name == "linear_row_blocks":
            raise AttributeError(name)
        return getattr(self.kernels, name)


@pytest.mark.parametrize(
    ("out_features", "in_features", "hint", "gemm"),
    [(960, 576, 64, True), (576, 1536, 64, True), (100, 37, 64, True), (7, 5, 64, True), (130, 24, 8, True),
     (64, 64, 1, False), (64, 64, 1, True), (200, 72, 512, True)],
)  # fmt: skip
def test_a_stale_packed_copy_is_rewritten_in_place_exactly(
    kernel: ModuleType, out_features: int, in_features: int, hint: int, gemm: bool
) -> None:
    """Row counts and column counts off the block and tile sizes (padding in oneDNN's layout), and hints of
    1, 8 and 512 rows: whatever layout oneDNN picks, the copy reads back as the weight, bit for bit;
    rewritten in place where the layout is row blocks, reordered anew where it is not (at one row,
    oneDNN here keeps the plain layout, unless the row-block GEMM has the copy made for 64 rows)."""
    kernels = kernel if gemm else _WithoutGemm(kernel)
    layer = packed_linear(kernels, out_features, in_features, hint)  # type: ignore[arg-type]
    assert layer._packed_for == (max(hint, 64) if hasattr(kernels, "linear_row_blocks") else hint)
    hint = layer._packed_for
    old = layer._packed
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features))
    layer.mark_packed_stale()
    in_place = row_block_layout(kernels, out_features, in_features, hint) is not None  # type: ignore[arg-type]
    assert layer.pack() == layer.weight.nbytes
    assert (layer._packed is old) == in_place and layer.packed_current()
    assert torch.equal(layer._packed.to_dense(), layer.weight)
    x = torch.randn(5, in_features)
    fresh = torch.ops.mkldnn._reorder_linear_weight(layer.weight, hint)
    onednn = torch.ops.mkldnn._linear_pointwise
    assert torch.equal(onednn(x, layer._packed, None, "none", [], ""), onednn(x, fresh, None, "none", [], ""))
    # The row-block GEMM reads the rewritten copy where it is in 64-row blocks (which hints give those is
    # oneDNN's choice for the CPU).
    layout = row_block_layout(kernels, out_features, in_features, hint)  # type: ignore[arg-type]
    row_blocks = hasattr(kernels, "linear_row_blocks") and layout is not None and layout[0] == 64
    assert (layer._row_blocks is not None) == row_blocks
    assert_runs_packed(layer, x)


def test_the_models_shapes_have_a_row_block_layout(kernel: ModuleType) -> None:
    """The shapes of the shipped models' layers (SmolLM2-135M, the tiny and small checkpoints) take the
    in-place path on this CPU: without it every swap reorders into fresh memory again."""
    for out_features, in_features in [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (768, 256)]:
        layout = row_block_layout(kernel, out_features, in_features, 64)
        assert layout is not None, (out_features, in_features)
        block, stride = layout
        assert block % 8 == 0 and stride >= in_features * block


def test_a_copy_made_on_other_threads_is_reordered_anew_on_a_swap(kernel: ModuleType) -> None:
    """oneDNN's layout follows torch's thread count (here 130 rows may be 16-row blocks for 2 threads and
    64-row blocks for 1): a copy made on one count and swapped on another is reordered anew, not rewritten
    under the other count's layout, and reads back as the new weight."""
    with torch_threads(1):
        layer = packed_linear(kernel, 130, 24)
    assert layer._packed_threads == 1
    old = layer._packed
    with torch_threads(2):
        with torch.no_grad():
            layer.weight.copy_(torch.randn(130, 24))
        layer.mark_packed_stale()
        assert layer.pack() == layer.weight.nbytes
        assert layer._packed is not old and layer._packed_threads == 2
        assert torch.equal(layer._packed.to_dense(), layer.weight)
        assert_runs_packed(layer, torch.randn(5, 24))


class _NoWrite:
    """Kernels whose pack_rows writes nothing: no candidate layout can read back."""

    @staticmethod
    def pack_rows(*args: object) -> None:
        return None


def test_without_a_known_layout_the_copy_is_reordered_anew() -> None:
    layer = packed_linear(_NoWrite(), 96, 64)  # type: ignore[arg-type]
    assert row_block_layout(_NoWrite(), 96, 64, 64) is None  # type: ignore[arg-type]
    old = layer._packed
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64))
    assert_runs_packed(layer, torch.randn(4, 64))
    assert layer._packed is not old and torch.equal(layer._packed.to_dense(), layer.weight)


def test_without_kernels_the_copy_is_reordered_anew() -> None:
    layer = packed_linear(None, 96, 64)
    old = layer._packed
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64))
    assert_runs_packed(layer, torch.randn(4, 64))
    assert layer._packed is not old


@pytest.mark.parametrize(("offset", "rows"), [(0, 96), (0, 40), (8, 16), (3, 70), (61, 35), (95, 1)])
def test_write_rows_fills_the_weight_and_its_packed_copy_in_one_pass(
    kernel: ModuleType, offset: int, rows: int
) -> None:
    """Pieces of a fused weight (q, k, v rows) start anywhere: strips of 8 rows cut at either end."""
    layer = packed_linear(kernel, 96, 44)
    old, before = layer._packed, layer.weight.detach().clone()
    layer.mark_packed_stale()
    src = torch.randn(rows, 44)
    piece = layer.weight.data.narrow(0, offset, rows)
    assert layer.write_rows(offset, piece, src)
    assert torch.equal(piece, src)
    want = before.clone()
    want[offset : offset + rows] = src
    assert torch.equal(layer.weight, want)
    assert layer._packed is not None
    dense = layer._packed.to_dense()
    assert torch.equal(dense[offset : offset + rows], src)  # the copy's other rows are rebuilt by pack()
    layer.pack()
    assert layer._packed is old and torch.equal(layer._packed.to_dense(), want)


@pytest.mark.parametrize("block", [8, 16, 64])
@pytest.mark.parametrize("misaligned", [0, 4])  # floats off a 64-byte line: the destination's line stores
@pytest.mark.parametrize(("offset", "rows", "columns"), [(0, 128, 40), (16, 48, 8), (5, 90, 44), (24, 17, 3)])
def test_pack_rows_writes_the_row_block_layout_at_any_alignment(
    kernel: ModuleType, block: int, misaligned: int, offset: int, rows: int, columns: int
) -> None:
    """Element (o, i) lands at (o // block) * stride + i * block + o % block, and the plain rows are an exact
    copy, whether or not the destinations start on a cache line (whole 16-row lines are stored past the
    caches only where they do) and wherever the piece starts; nothing outside the piece is touched."""
    total, stride = offset + rows, columns * block + 16
    num_blocks = -(-total // block)
    buffer = torch.full((num_blocks * stride + 32,), -1.0)
    start = (-buffer.data_ptr() // 4) % 16 + misaligned  # floats to the first 64-byte line, then off it
    src = torch.randn(rows, columns)
    plain_buffer = torch.full((rows * columns + 32,), -1.0)
    plain_start = (-plain_buffer.data_ptr() // 4) % 16 + misaligned
    plain = plain_buffer[plain_start : plain_start + rows * columns].view(rows, columns)
    kernel.pack_rows(src, offset, buffer.data_ptr() + 4 * start, num_blocks * stride, block, stride, plain)
    o = torch.arange(offset, total).unsqueeze(1)
    i = torch.arange(columns).unsqueeze(0)
    want = torch.full_like(buffer, -1.0)
    want[start + (o // block) * stride + i * block + o % block] = src
    assert torch.equal(buffer, want)
    assert torch.equal(plain, src)
    assert (plain_buffer[:plain_start] == -1).all() and (plain_buffer[plain_start + rows * columns :] == -1).all()


def test_write_rows_declines_what_it_cannot_write_in_one_pass(kernel: ModuleType) -> None:
    layer = packed_linear(kernel, 96, 64)
    piece = layer.weight.data.narrow(0, 0, 96)
    assert layer.takes_rows(piece, torch.randn(96, 64))
    assert not layer.takes_rows(piece, torch.randn(64, 96).t())  # not contiguous
    assert not layer.takes_rows(piece, torch.randn(96, 64, dtype=torch.float64))  # copy_ casts it
    assert not layer.takes_rows(piece.narrow(0, 0, 95), torch.randn(96, 64))  # not the piece's shape
    assert not packed_linear(None, 96, 64).takes_rows(piece, torch.randn(96, 64))  # no kernels


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_write_rows_tells_whether_every_value_it_wrote_was_finite(kernel: ModuleType, bad: float, where: str) -> None:
    """The finite check rides on the write: one bad value anywhere (any strip, any thread's share, the
    partial strip at the end) makes it False, and the rows are written all the same."""
    layer = packed_linear(kernel, 96, 44)
    layer.mark_packed_stale()
    src = torch.randn(93, 44)
    piece = layer.weight.data.narrow(0, 3, 93)
    assert layer.takes_rows(piece, src) and layer.write_rows(3, piece, src)
    row = {"first": 0, "middle": 50, "last": 92}[where]
    src[row, 43 if where == "last" else 7] = bad
    assert not layer.write_rows(3, piece, src)
    torch.testing.assert_close(piece, src, rtol=0, atol=0, equal_nan=True)  # written all the same


@pytest.mark.parametrize("problem", ["too small", "block", "stride", "dtype", "plain shape"])
def test_pack_rows_refuses_a_layout_that_does_not_fit(kernel: ModuleType, problem: str) -> None:
    layer = packed_linear(kernel, 96, 64)
    assert layer._packed is not None
    address, floats = torch.ops.mkldnn.data_ptr(layer._packed), torch.ops.mkldnn._nbytes(layer._packed) // 4
    weight, block, stride, plain = layer.weight.detach().clone(), 64, floats // 2, None
    if problem == "too small":
        floats -= 1
    elif problem == "block":
        block = 12
    elif problem == "stride":
        stride = 64 * 64 - 1
    elif problem == "dtype":
        weight = weight.double()
    else:
        plain = torch.empty(95, 64)
    before = layer._packed.to_dense()
    with pytest.raises(RuntimeError, match="pack_rows"):
        kernel.pack_rows(weight, 0, address, floats, block, stride, plain)
    assert torch.equal(layer._packed.to_dense(), before)  # refused before any write
