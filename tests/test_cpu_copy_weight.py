"""Specification of the plain weight copy of a weight write (``copy_weight``): where ``pack_rows`` writes a
linear layer's packed copy, every other float32 weight (the embedding, the norms) is copied past the caches
by the kernels, which tell in the same pass whether every value was finite; ``loader.copy_weight`` falls back
to torch's copy and one more read where they do not apply. How a whole update uses it is in
``test_control.py``.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch


@pytest.mark.parametrize("misaligned", [0, 1, 5])  # floats off a 64-byte line: the line stores start later
@pytest.mark.parametrize("size", [1, 15, 16, 17, 1000, 16384 * 3 + 7])  # the last spans three chunks and a bit
def test_copy_weight_copies_every_value_and_tells_whether_all_were_finite(
    kernel: ModuleType, misaligned: int, size: int
) -> None:
    buffer = torch.zeros(size + 32)
    start = (-buffer.data_ptr() // 4) % 16 + misaligned
    dst, src = buffer.narrow(0, start, size), torch.randn(size)
    assert kernel.copy_weight(dst, src) and torch.equal(dst, src)
    assert buffer[:start].eq(0).all() and buffer[start + size :].eq(0).all()  # nothing outside dst
    for at in sorted({0, size // 2, size - 1}):
        for bad in (float("nan"), float("inf"), -float("inf")):
            src = torch.randn(size)
            src[at] = bad
            assert not kernel.copy_weight(dst, src)
            torch.testing.assert_close(dst, src, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("problem", ["dtype", "size", "not contiguous", "itself"])
def test_copy_weight_refuses_what_it_cannot_copy(kernel: ModuleType, problem: str) -> None:
    dst, src = torch.zeros(8, 16), torch.randn(8, 16)
    if problem == "dtype":
        src = src.double()
    elif problem == "size":
        src = torch.randn(8, 15)
    elif problem == "not contiguous":
        src = torch.randn(16, 8).t()
    else:
        src = dst
    with pytest.raises(RuntimeError, match="copy_weight"):
        kernel.copy_weight(dst, src)


@pytest.mark.parametrize("with_kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_copy_checks_values_only_when_asked(
    kernel: ModuleType, with_kernels: bool, dtype: torch.dtype
) -> None:
    """``loader.copy_weight``: the kernels' pass where it fits (float32 both sides), torch's copy and one
    more read elsewhere; the values land either way."""
    from aioengine.model.loader import copy_weight

    dst, src = torch.zeros(40, 24), torch.randn(40, 24).to(dtype)
    src[7, 3] = float("inf")
    kernels = kernel if with_kernels else None
    assert copy_weight(dst, src, kernels, check_finite=False)
    assert not copy_weight(dst, src, kernels, check_finite=True)
    assert torch.equal(dst, src.float())
    src[7, 3] = 1.0
    assert copy_weight(dst, src, kernels, check_finite=True) and torch.equal(dst, src.float())
