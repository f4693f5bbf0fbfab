"""Where a oneDNN-reordered weight keeps its values: the row-block layout the kernels' GEMM reads
(``linear_row_blocks``) and ``pack_rows`` writes in place, found by probing oneDNN rather than assumed. ``Linear``
(``linear.py``) asks it whether its copy can be read and rewritten in place."""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

logger = logging.getLogger(__name__)


GEMM_BLOCK = 64
"""The row block of the copies ``linear_row_blocks`` reads."""


def has_row_block_gemm(kernels: ModuleType | None) -> bool:
    """Whether these kernels have ``linear_row_blocks`` (AVX-512 and AVX2 builds do)."""
    return hasattr(kernels, "linear_row_blocks")


def packed_floats(packed: torch.Tensor) -> int:
    """The floats a oneDNN-reordered copy holds (its layout may pad past the weight's)."""
    return int(torch.ops.mkldnn._nbytes(packed)) // 4


def row_block_layout(kernels: ModuleType, out_features: int, in_features: int, hint: int) -> tuple[int, int] | None:
    """``(block, block_stride)`` of ``pack_rows`` under which oneDNN lays out an ``[out, in]``
    float32 weight reordered for ``hint`` rows here on torch's current thread count (the layout follows
    it too), or None (it then is reordered anew, as before).

    oneDNN chooses the layout, so it is found, not assumed: for each candidate block size a probe of
    distinct values is written in place into a fresh reorder of zeros and read back through oneDNN's own
    ``to_dense``; the first candidate that returns the probe exactly is the layout. Once per shape, thread
    count and process (the first swap pays it: ~0.2 s for a 49k-row LM head)."""
    return _probed_layout(kernels, out_features, in_features, hint, torch.get_num_threads())


@functools.cache
def _probed_layout(
    kernels: ModuleType, out_features: int, in_features: int, hint: int, threads: int
) -> tuple[int, int] | None:
    """``row_block_layout``'s probe, cached by thread count as well (run on ``threads``: torch's count now)."""
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "data_ptr") and hasattr(ops, "_nbytes")):
        return None
    # Distinct, normal floats (1.0 upwards, one ulp apart): unlike random draws, no two can be equal.
    one = 0x3F800000
    probe = torch.arange(out_features * in_features, dtype=torch.int32).add_(one).view(torch.float32)
    probe = probe.view(out_features, in_features)
    for block in (64, 32, 16, 8, 48, 128):
        target = ops._reorder_linear_weight(torch.zeros_like(probe), hint)
        floats, blocks = packed_floats(target), -(-out_features // block)
        if floats % blocks or floats // blocks < in_features * block:
            continue
        kernels.pack_rows(probe, 0, ops.data_ptr(target), floats, block, floats // blocks)
        if torch.equal(target.to_dense(), probe):
            return block, floats // blocks
    logger.info("no in-place layout for a [%d, %d] oneDNN weight; swaps reorder it anew", out_features, in_features)
    return None
