"""The screen that greedy steps read an lm_head through (``Linear.first_max``): a copy of its weight in int8 and
bfloat16 (``kernels.pack_greedy_screen``), from which ``kernels.greedy_screen_argmax`` finds each row's first
maximum exactly, summing in float32 only the rows of the weight the copy cannot rule out.

The copy splits the input dimensions in two: most in int8 (four multiply-adds a lane, a quarter of float32's
bytes), the rest in bfloat16 (two a lane, half the bytes). How many rows the screen leaves for float32 follows
the error of the rows' products, and int8 has that error small only where no dimension of x dwarfs the others.
A trained model's final hidden rows hold most of their energy in a few fixed dimensions (SmolLM2-135M's: 64 of
576 hold 89% of it); with those in bfloat16 and the rest in int8, 19 rows on average are left for float32 there
(80 at most, over 940 real rows) against 6.5 (34) for a bfloat16 copy of everything, at 0.56x the multiply-adds.
Where no few dimensions dominate (random-init checkpoints), the copy stays bfloat16 throughout, the screen as it
was before the split: int8 would leave most rows for float32.

The split is chosen from the first ``SAMPLE_ROWS`` rows screened (bfloat16 throughout until then), once: an
answer never depends on it, only how many rows float32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

SAMPLE_ROWS = 256
"""Rows of x seen before the split is chosen."""
BF16_DIMS = 64
"""The dimensions kept in bfloat16 where x's energy sits in a few: the ``BF16_DIMS`` that hold the most of it."""
BF16_SHARE = 0.8
"""The share of x's energy those dimensions must hold for the rest to go to int8."""


@dataclass(frozen=True, slots=True)
class ScreenCopy:
    """What ``greedy_screen_argmax`` reads besides x and the float32 copy."""

    packed: torch.Tensor
    norms: torch.Tensor
    order: torch.Tensor
    """The input dimensions, those in int8 first."""
    int8_dims: int
    generation: int
    """The weight copy's generation it was made from (``Linear._generation``)."""


class GreedyScreen:
    """One lm_head's screen: its copy, kept in step with the weight's float32 copy, and the split of the
    dimensions, chosen from the rows it screens."""

    def __init__(self, kernels: ModuleType, in_features: int) -> None:
        self.kernels = kernels
        self.in_features = in_features
        self.copy: ScreenCopy | None = None
        self.order = torch.arange(in_features)
        self.int8_dims = 0
        self._energy = torch.zeros(in_features, dtype=torch.float64)
        self._rows_seen = 0

    @staticmethod
    def available(kernels: ModuleType | None) -> bool:
        """Whether these kernels have the screen (AVX-512 builds with AVX512-BF16 and AVX512-VNNI)."""
        return hasattr(kernels, "pack_greedy_screen")

    def drop(self) -> None:
        """Frees the copy (sleep, or the weight's copy dropped); the split is kept."""
        self.copy = None

    def copy_for(self, weight_copy: tuple[int, int, int, int], generation: int) -> ScreenCopy:
        """The copy for the float32 copy ``weight_copy`` (``Linear.row_block_weight()``) at ``generation``: made
        again, into the old tensors where their shapes fit, after the weight or the split changed."""
        copy = self.copy
        if copy is None or copy.generation != generation or copy.order is not self.order:
            address, floats, out_features, stride = weight_copy
            into = (copy.packed, copy.norms) if copy is not None else (None, None)
            packed, norms = self.kernels.pack_greedy_screen(
                address, floats, out_features, self.in_features, stride, self.order, self.int8_dims, *into
            )
            copy = self.copy = ScreenCopy(packed, norms, self.order, self.int8_dims, generation)
        return copy

    def argmax(
        self,
        x: torch.Tensor,
        weight_copy: tuple[int, int, int, int],
        generation: int,
        bias: torch.Tensor | None,
        rows: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Each row's first maximum of ``x @ W.T + bias``, or None where the screen cannot vouch for it. ``rows``:
        W itself, holding the copy's values (the plain weight where it is kept), from which the rows left for
        float32 are read a run of memory each (the row-block copy gives them a cache line for each value)."""
        if self._rows_seen < SAMPLE_ROWS:
            self._observe(x)
        copy = self.copy_for(weight_copy, generation)
        address, floats, out_features, stride = weight_copy
        tokens = self.kernels.greedy_screen_argmax(
            x, copy.packed, copy.norms, copy.order, copy.int8_dims, address, floats, out_features, stride, bias, rows
        )
        return tokens if tokens.numel() == x.shape[0] else None

    def _observe(self, x: torch.Tensor) -> None:
        """Adds x's rows to the energy per dimension; at ``SAMPLE_ROWS`` rows, chooses the split."""
        if not bool(torch.isfinite(x).all()):
            return
        self._energy += x.detach().double().square().sum(dim=0)
        self._rows_seen += x.shape[0]
        if self._rows_seen < SAMPLE_ROWS or self.in_features <= BF16_DIMS:
            return
        top = torch.topk(self._energy, BF16_DIMS).indices
        total = float(self._energy.sum())
        if total > 0 and float(self._energy[top].sum()) >= BF16_SHARE * total:
            int8 = torch.ones(self.in_features, dtype=torch.bool)
            int8[top] = False
            self.order = torch.cat([int8.nonzero().flatten(), top.sort().values])
            self.int8_dims = self.in_features - BF16_DIMS
