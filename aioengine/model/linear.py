"""The linear layer and its packed weights: ``Linear`` runs from a oneDNN-reordered copy of its weight on
CPU (multiplied there by oneDNN or by the kernels' row-block GEMM), rewritten in place on a swap. The
model-wide switches over every such layer (packing on or off, stale, dropped, plain weights released) are in
``packing.py``."""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from aioengine.model.greedy_screen import GreedyHead, GreedyScreen, ScreenCopy
from aioengine.model.onednn_layout import GEMM_BLOCK, has_row_block_gemm, packed_floats, row_block_layout
from aioengine.model.parallel import TensorParallel

logger = logging.getLogger(__name__)


def cpu_prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``Linear`` can run from oneDNN-reordered weights here: CPU, float32, oneDNN ops present."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class Linear(nn.Linear):
    """``nn.Linear`` that can run from a oneDNN-reordered copy of its weight (CPU, float32).

    torch's CPU ``F.linear`` calls MKL's sgemm, which packs the weight again on every call; for the
    few rows of a decode step that packing is most of the GEMM, and on AMD CPUs MKL also takes a
    generic code path. oneDNN with the weight reordered once runs the same GEMMs 1.5-7x faster here
    (``python -m benchmarks gemm``). The copy follows the weight: the first forward after it was
    marked stale (every write through ``WeightPlan`` and ``model.weights_changed()`` do that) or
    dropped (sleep), or after the weight's storage or version changed, reorders it again: into the
    existing copy where the kernels know its layout (``pack_rows``: a swap then touches no fresh
    memory, and writes the copy in the same pass as the weight), else anew. It costs a second copy
    of the weight in memory, unless the plain weight is released (below).

    Where the kernels have ``linear_row_blocks`` (AVX-512 and AVX2 builds) and the copy is laid out in
    64-row blocks (checked value for value each time it is made), the GEMM runs there instead of in
    oneDNN, reading the same copy: with AVX-512 1.05-1.75x oneDNN's speed for the 1-64 rows of a decode
    step, level from 128 rows; with AVX2 level with oneDNN (``python -m benchmarks gemm``), and what it
    brings there is the one-call decoder layer and the greedy lm_head built on it.

    With ``keep_plain`` off (the model runner's choice for layers that own their weight alone), a copy
    that the kernels can rewrite in place becomes the weight's one store once it is made: the parameter
    is replaced by one of its shape and dtype on the meta device (no memory; reading it fails loudly
    instead of giving stale values), writes go into the copy alone (``write_rows``), and
    ``dense_weight()`` (``packing.dense_parameters`` for a model) reads the values back. That halves the layer's
    memory and the bytes a swap writes.
    """

    prepack_hint: int | None = None
    """None: plain ``F.linear``. Otherwise packing is on, reordered for batches of about this many rows."""
    kernels: ModuleType | None = None
    """The C++ CPU kernels (``use_cpu_kernels``): with them a stale copy is rebuilt in place."""
    _packed: torch.Tensor | None = None
    _packed_key: tuple[int, int] | None = None
    _packed_source: torch.UntypedStorage | None = None
    """The storage the copy was made from, held so a swapped-in storage can never reuse its address."""
    _rows_packed: int = 0
    """Rows written into the stale copy by ``write_rows`` since it was marked stale (all: it is current)."""
    _packed_for: int = 0
    """The rows oneDNN reordered the copy for (``reorder_hint()`` when it was made): its layout follows."""
    _packed_threads: int = 0
    """torch's thread count when the copy was made: oneDNN's layout follows it too (on an AVX2 host, 130 rows
    for 2 threads are laid out in 16-row blocks, for 1 in 64-row blocks)."""
    _row_blocks: tuple[int, int, int] | None = None
    """``(address, floats, block_stride)`` of the copy where ``kernels.linear_row_blocks`` reads it (64-row
    blocks, checked against the weight); None: oneDNN's GEMM."""
    greedy_screen: bool = False
    """Whether ``first_max`` screens with an int8 / bfloat16 copy of the weight (``set_greedy_screen``; the model
    runner turns it on for the lm_head)."""
    _screen: GreedyScreen | None = None
    _generation: int = 0
    """Counts the changes of the packed copy (made, written, marked stale, dropped): a screen made at another
    count is rebuilt before it is read."""
    keep_plain: bool = True
    """False: once a copy is made that ``pack_rows`` rewrites in place, the plain weight is released."""
    _released: tuple[int, int] | None = None
    """The layout (``row_block_layout``) of the copy while it is the weight's one store (plain released)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias``, from the packed copy where packing is on."""
        if not self._ensure_packed():
            return F.linear(x, self.weight, bias)
        if self._row_blocks is not None and self.kernels is not None and x.dim() == 2 and x.stride(1) == 1:
            address, floats, stride = self._row_blocks
            return self.kernels.linear_row_blocks(x, address, floats, self.out_features, stride, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    def first_max(self, x: torch.Tensor) -> torch.Tensor | None:
        """The index of the first maximum of each row of ``self(x)`` ([rows] int64), computed without writing
        that output (greedy over an lm_head: a step's logits are [rows, vocab]); None where ``project`` would
        not run the row-block GEMM. Equal to ``argmax_rows(self(x))``: NaN ignored.

        With ``greedy_screen`` on and kernels that have it (AVX512-BF16 and AVX512-VNNI hosts), a copy of the
        weight in int8 and bfloat16 screens every row and float32 sums only the rows it cannot rule out
        (``greedy_screen.py``): the same answer, bit for bit, at about a third of the float32 GEMM's cost. Where
        the screen cannot vouch for its answer the float32 GEMM answers."""
        copy = self.row_block_weight() if x.dim() == 2 and x.stride(1) == 1 else None
        if copy is None:
            return None
        assert self.kernels is not None
        screen = self._screen_object()
        if screen is not None:
            tokens = screen.argmax(x, copy, self._generation, self.bias, self._screen_rows())
            if tokens is not None:
                return tokens
        address, floats, out_features, stride = copy
        return self.kernels.linear_row_blocks_argmax(x, address, floats, out_features, stride, self.bias)

    def greedy_head(self) -> GreedyHead | None:
        """What a kernel that picks greedy tokens over this lm_head itself reads (``kernels.greedy_decode_window``):
        what ``first_max`` reads, the screen's copy made current first. None where ``first_max`` would not run the
        row-block kernels, or would still show its rows to a screen choosing its split."""
        copy = self.row_block_weight()
        if copy is None:
            return None
        screen = self._screen_object()
        if screen is None:
            return GreedyHead(copy, self.bias)
        if not screen.split_chosen:
            return None
        return GreedyHead(copy, self.bias, screen.read_copy(copy, self._generation), self._screen_rows())

    def _screen_rows(self) -> torch.Tensor | None:
        """The weight as the screen reads its rows left for float32: the plain weight where it is kept in float32."""
        plain = self.weight.detach() if self._released is None else None
        return plain if plain is not None and plain.dtype == torch.float32 and plain.is_contiguous() else None

    def set_greedy_screen(self, on: bool) -> None:
        """``greedy_screen`` on or off; off frees the screen and its copy."""
        self.greedy_screen = on
        if not on:
            self._screen = None

    def greedy_screen_copy(self) -> ScreenCopy | None:
        """The copy ``greedy_screen_argmax`` reads, made from the row-block copy as it is now (again after any
        write to it, into the same memory): the first greedy step pays it, and after a weight write or a wake the
        write or wake does (``refresh_greedy_screen``). None where the screen is off or these kernels lack it. On
        CPU the KV cache takes a quarter of the free host memory (``cpu_worker.CPU_KV_SHARE``), so the copy (at
        most half the head's weight) fits beside it."""
        copy = self.row_block_weight()  # brought up to the weight first: the screen is made from it
        screen = self._screen_object()
        return None if copy is None or screen is None else screen.copy_for(copy, self._generation)

    def refresh_greedy_screen(self) -> None:
        """Makes the screen's copy again now, after a weight write or a wake, where greedy steps read the copy it
        replaces (``GreedyScreen.read_since_made``): the write or wake pays for it inside its own pause, and the
        first greedy step after it runs at its usual cost. Where none did, the next greedy step makes it, if one
        comes."""
        if self._screen is not None and self._screen.read_since_made:
            self.greedy_screen_copy()

    def _screen_object(self) -> GreedyScreen | None:
        if not self.greedy_screen or self.kernels is None or not GreedyScreen.available(self.kernels):
            return None
        if self._screen is None:
            self._screen = GreedyScreen(self.kernels, self.in_features)
        return self._screen

    def row_block_weight(self) -> tuple[int, int, int, int] | None:
        """``(address, floats, out_features, block_stride)``: the packed copy as ``linear_row_blocks`` reads it,
        for a caller that runs the GEMM itself (``kernels.decoder_layers``); rebuilt first where stale, as
        ``project`` does. None where ``project`` would not run that GEMM."""
        if not self._ensure_packed() or self._row_blocks is None or self.kernels is None:
            return None
        address, floats, stride = self._row_blocks
        return address, floats, self.out_features, stride

    def _ensure_packed(self) -> bool:
        """Whether packing is on and the copy holds the current weight, rebuilding a stale copy first."""
        if self.prepack_hint is None:
            return False
        # The parameter without nn.Module's __getattr__ (~0.4 us): this runs for every linear of every step.
        weight = self._parameters["weight"]
        assert weight is not None
        if torch.is_grad_enabled() and weight.requires_grad:
            return False  # the oneDNN op has no autograd: inference only
        return self._packed_key == _weight_key(weight) or self.pack() > 0

    def pack(self) -> int:
        """Reorders the current weight now; returns the bytes of the copy. Turns packing off on error."""
        assert self.prepack_hint is not None
        self._generation += 1
        if self._released is not None:  # the copy is the weight: every write went into it
            self._packed_key = _weight_key(self.weight)
            return self.weight.nbytes
        weight = self.weight.detach()
        if not self._pack_in_place(weight):
            try:
                self._packed_for, self._packed_threads = self.reorder_hint(), torch.get_num_threads()
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, self._packed_for)
            except RuntimeError as exc:  # e.g. a dtype this CPU's oneDNN has no kernel for
                logger.warning("oneDNN weight reorder failed (%s); this layer runs F.linear", exc)
                self.prepack_hint = None
                self.drop_packed()
                return 0
            self._row_blocks = self._checked_row_blocks(weight)
        self._packed_key = _weight_key(self.weight)
        self._packed_source = weight.untyped_storage()
        if not self.keep_plain:
            self._release_plain(weight)
        return weight.nbytes

    @property
    def plain_released(self) -> bool:
        """Whether the packed copy is the weight's one store (the parameter is a meta placeholder)."""
        return self._released is not None

    def dense_weight(self) -> torch.Tensor:
        """The weight's values as an ``[out, in]`` tensor: the parameter, or one read back from the copy."""
        if self._released is None or self._packed is None:
            return self.weight.detach()
        return self._packed.to_dense()

    def _release_plain(self, weight: torch.Tensor) -> None:
        layout = self._in_place_layout(weight)
        if layout is None:
            return  # only a copy the kernels can rewrite in place can take the weight's writes
        self._released = layout
        self._packed_source = None
        # A new parameter object: one may not point an existing CPU parameter at meta data.
        self.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)
        self._packed_key = _weight_key(self.weight)

    def packed_current(self) -> bool:
        """Whether a packed copy exists and was made from the weight as it is now (as far as can be seen:
        writes through ``.data`` show only through ``mark_packed_stale``, which every weight write calls)."""
        return self._packed is not None and self._packed_key == _weight_key(self.weight)

    def _pack_in_place(self, weight: torch.Tensor) -> bool:
        """Brings the packed copy it already has (stale, same shape) up to ``weight`` without fresh memory:
        nothing to do where a weight write already wrote every row into it (``write_rows``), else the
        kernels rewrite it where they know oneDNN's layout; False where it must be reordered anew."""
        layout = self._in_place_layout(weight)
        if layout is None:
            return False
        if self._rows_packed != weight.shape[0]:
            self._write_packed(weight, 0, layout, None)
        self._rows_packed = 0
        # Every row is now written under the proven layout, so the GEMM may read it if it is 64-row blocks.
        self._row_blocks = self._row_blocks_at(layout[1]) if layout[0] == GEMM_BLOCK else None
        return True

    def reorder_hint(self) -> int:
        """The rows a fresh copy is reordered for: ``prepack_hint``, but at least 64 where the row-block
        GEMM can read the copy. It runs every row count itself, and oneDNN lays out a copy for 64 rows in
        the 64-row blocks it reads, where for fewer it may pick another layout (at one row, the plain one)."""
        assert self.prepack_hint is not None
        if has_row_block_gemm(self.kernels):
            return max(self.prepack_hint, GEMM_BLOCK)
        return self.prepack_hint

    def _row_blocks_at(self, stride: int) -> tuple[int, int, int] | None:
        """``_row_blocks`` of the copy read as 64-row blocks at ``stride``; None without the GEMM."""
        if self._packed is None or not has_row_block_gemm(self.kernels):
            return None
        return torch.ops.mkldnn.data_ptr(self._packed), packed_floats(self._packed), stride

    def _checked_row_blocks(self, weight: torch.Tensor) -> tuple[int, int, int] | None:
        """The copy just made by oneDNN, as ``linear_row_blocks`` reads it, if it holds ``weight`` in 64-row
        blocks value for value (one read of each); else None (oneDNN's GEMM reads it)."""
        kernels, packed = self.kernels, self._packed
        if kernels is None or packed is None or not has_row_block_gemm(kernels):
            return None
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
            return None
        floats, blocks = packed_floats(packed), -(-weight.shape[0] // GEMM_BLOCK)
        if floats % blocks or floats // blocks < weight.shape[1] * GEMM_BLOCK:
            return None
        view = self._row_blocks_at(floats // blocks)
        if view is None or not kernels.row_blocks_equal(weight, view[0], floats, GEMM_BLOCK, view[2]):
            return None
        return view

    def takes_rows(self, piece: torch.Tensor, src: torch.Tensor) -> bool:
        """Whether ``write_rows`` writes ``src`` into the rows ``piece`` (a view of the weight) and the packed
        copy in one pass over ``src``. Where not, the caller copies into ``piece`` and the copy is rebuilt once
        the weight is complete. A released weight takes ``src`` of any dtype, device or layout into its copy."""
        if self._released is not None:
            return True
        layout = self._in_place_layout(self.weight)
        if layout is None or src.dtype != torch.float32 or src.device.type != "cpu" or not src.is_contiguous():
            return False
        return tuple(src.shape) == tuple(piece.shape) and piece.is_contiguous()

    def write_rows(self, offset: int, piece: torch.Tensor, src: torch.Tensor) -> bool:
        """Copies ``src`` into rows ``[offset, offset + len(src))`` of the weight (``piece`` is that view of
        it) and of the packed copy, in one pass over ``src``, where ``takes_rows``. Returns whether every value
        of ``src`` is finite (the kernel reads each strip back while it is in cache)."""
        self._generation += 1
        if self._released is not None:
            if tuple(src.shape) != tuple(piece.shape):
                raise ValueError(f"write_rows: src has shape {tuple(src.shape)}, the rows {tuple(piece.shape)}")
            values = src.to(device="cpu", dtype=torch.float32).contiguous()
            return self._write_packed(values, offset, self._released, None)
        layout = self._in_place_layout(self.weight)
        assert layout is not None, "write_rows without takes_rows"
        finite = self._write_packed(src, offset, layout, piece)
        self._rows_packed += src.shape[0]
        return finite

    def _in_place_layout(self, weight: torch.Tensor) -> tuple[int, int] | None:
        packed, kernels = self._packed, self.kernels
        if packed is None or kernels is None or self.prepack_hint is None or tuple(packed.shape) != tuple(weight.shape):
            return None
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
            return None
        if torch.get_num_threads() != self._packed_threads:  # the probe would find another count's layout
            return None
        return row_block_layout(kernels, weight.shape[0], weight.shape[1], self._packed_for)

    def _write_packed(
        self, src: torch.Tensor, offset: int, layout: tuple[int, int], plain: torch.Tensor | None
    ) -> bool:
        """``pack_rows``: ``src`` into the copy at row ``offset`` (and ``plain``); whether it was all finite."""
        assert self._packed is not None and self.kernels is not None
        address, floats = torch.ops.mkldnn.data_ptr(self._packed), packed_floats(self._packed)
        return bool(self.kernels.pack_rows(src.detach(), offset, address, floats, *layout, plain))

    def mark_packed_stale(self) -> None:
        """The weight was (or is being) written: the next forward or ``pack`` rebuilds the copy, in place
        where it can, so the copy's memory is kept."""
        self._packed_key = None
        self._rows_packed = 0
        self._generation += 1

    def drop_packed(self, keep_values: bool = True) -> None:
        """Frees the packed copy (sleep, a lost write, packing turned off). Where it was the weight's one store
        the plain weight comes back first: read from the copy, or (``keep_values=False``: the weights are
        being discarded) uninitialised."""
        if self._released is not None:
            shape, dtype = self.weight.shape, self.weight.dtype
            plain = self.dense_weight() if keep_values else torch.empty(shape, dtype=dtype)
            self.weight = nn.Parameter(plain, requires_grad=False)
            self._released = None
        self._packed = None
        self._row_blocks = None
        self._packed_key = None
        self._packed_source = None
        self._rows_packed = 0
        if self._screen is not None:
            self._screen.drop()  # the copy; the split of the dimensions stays
        self._generation += 1


class RowParallelLinear(Linear):
    """A linear layer whose input features are split over the tensor-parallel ranks: each rank multiplies
    its slice, the partial sums are all-reduced, and the bias (replicated) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.project(x, self.bias)
        out = self.tp.all_reduce(self.project(x, None))
        return out if self.bias is None else out + self.bias


def _weight_key(weight: torch.Tensor) -> tuple[int, int]:
    """Changes whenever the weight's storage is swapped or it is written in place."""
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor tracks no version: only a storage swap shows
        version = -1
    return weight.data_ptr(), version
