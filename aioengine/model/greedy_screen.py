"""The screen that greedy steps read an lm_head through (``Linear.first_max``): a copy of its weight in int8 and
bfloat16 (``kernels.pack_greedy_screen``), from which ``kernels.greedy_screen_argmax`` finds each row's first
maximum exactly, summing in float32 only the rows of the weight the copy cannot rule out.

The copy splits the input dimensions in two (a ``Split``): those in int8 (four multiply-adds a lane, a quarter of
float32's bytes), the rest in bfloat16 (two a lane, half the bytes). How many rows the screen leaves for float32
follows the error of the rows' products, and int8 has that error small only where no dimension of x dwarfs the
others: each row of x is scaled to int8 by its largest value. So the split is the cheapest of three whose int8
part keeps x's error within ``INT8_ERROR`` on the rows sampled:

- every dimension in int8, where x's energy is spread (random-init checkpoints: the largest value of a row ~3x
  its rms, an error of 0.7-0.8%; tiny's head 1.5x faster than all in bfloat16, small's 1.2x);
- the ``BF16_DIMS`` dimensions that hold the most of x's energy in bfloat16, the rest in int8, where a few fixed
  dimensions dwarf the others, as in a trained model's final hidden rows (SmolLM2-135M's: 64 of 576 hold 89% of
  the energy, the largest value of a row ~18x its rms; 4.1% in int8 throughout, 0.28% split so): 19 rows left for
  float32 on average (80 at most, over 940 real rows) against 6.5 (34) all in bfloat16, at 0.56x the multiply-adds;
- every dimension in bfloat16 otherwise.

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
INT8_ERROR = 0.01
"""The most error x's int8 part may carry: |x_I - x~_I| / |x|, averaged over the rows sampled."""
MAX_INT8_DIMS = 1 << 16
"""The most dimensions the kernel takes in int8 (its int32 sums cannot overflow below)."""


@dataclass(frozen=True, slots=True, eq=False)
class Split:
    """Which input dimensions the screen's copy holds in int8: the first ``int8_dims`` of ``order``; the rest are in
    bfloat16. Compared by identity: a copy made for one split is made again for another."""

    order: torch.Tensor
    """A permutation of the input dimensions, those in int8 first."""
    int8_dims: int

    @classmethod
    def bfloat16(cls, in_features: int) -> Split:
        return cls(torch.arange(in_features), 0)


def int8_error(rows: torch.Tensor, dims: torch.Tensor) -> float:
    """|x_I - x~_I| / |x| averaged over ``rows`` (finite, float64), x~_I the int8 rounding of x's ``dims`` that the
    kernel makes (each row scaled so its largest value there is 127, to nearest); rows of zeros left out."""
    part = rows[:, dims]
    scale = part.abs().amax(dim=1, keepdim=True) / 127
    rounded = torch.where(scale > 0, (part / scale).round() * scale, torch.zeros_like(part))
    norms = rows.norm(dim=1)
    kept = norms > 0
    return float(((part - rounded).norm(dim=1)[kept] / norms[kept]).mean()) if bool(kept.any()) else 0.0


def choose_split(rows: torch.Tensor) -> Split:
    """The cheapest split whose int8 part keeps the error of ``rows`` (finite) within ``INT8_ERROR``: every
    dimension in int8; else the ``BF16_DIMS`` loudest in bfloat16, the rest in int8; else all in bfloat16."""
    rows = rows.double()
    k = rows.shape[1]
    splits = [Split(torch.arange(k), k)]
    if k > BF16_DIMS:
        loud = torch.topk(rows.square().sum(dim=0), BF16_DIMS).indices.sort().values
        quiet = torch.ones(k, dtype=torch.bool)
        quiet[loud] = False
        splits.append(Split(torch.cat([quiet.nonzero().flatten(), loud]), k - BF16_DIMS))
    for split in splits:
        if split.int8_dims <= MAX_INT8_DIMS and int8_error(rows, split.order[: split.int8_dims]) <= INT8_ERROR:
            return split
    return Split.bfloat16(k)


@dataclass(frozen=True, slots=True, eq=False)  # compared by identity: == over tensors compares their elements
class ScreenCopy:
    """What ``greedy_screen_argmax`` reads besides x and the float32 copy."""

    packed: torch.Tensor
    norms: torch.Tensor
    split: Split
    generation: int
    """The weight copy's generation it was made from (``Linear._generation``)."""


@dataclass(frozen=True, slots=True, eq=False)
class GreedyHead:
    """An lm_head as a kernel that picks greedy tokens itself reads it (``Linear.greedy_head``): its row-block copy
    and bias, and where greedy steps screen it, the screen's copy and the plain rows ``greedy_screen_argmax``
    reads."""

    copy: tuple[int, int, int, int]
    """``Linear.row_block_weight()``."""
    bias: torch.Tensor | None
    screen: ScreenCopy | None = None
    rows: torch.Tensor | None = None

    def screen_args(self) -> dict[str, object]:
        """The screen's keyword arguments to ``kernels.greedy_decode_window`` (none without a screen)."""
        if self.screen is None:
            return {}
        screen = self.screen
        return {
            "screen_packed": screen.packed,
            "screen_norms": screen.norms,
            "screen_order": screen.split.order,
            "screen_int8_dims": screen.split.int8_dims,
            "screen_rows": self.rows,
        }


class GreedyScreen:
    """One lm_head's screen: its copy, kept in step with the weight's float32 copy, and the split of the
    dimensions, chosen from the rows it screens."""

    def __init__(self, kernels: ModuleType, in_features: int) -> None:
        self.kernels = kernels
        self.in_features = in_features
        self.copy: ScreenCopy | None = None
        self.split = Split.bfloat16(in_features)
        self._sample: list[torch.Tensor] = []
        """Rows of x seen so far, until the split is chosen."""
        self._rows_seen = 0
        self.read_since_made = False
        """Whether a greedy step read the screen since its copy was last made: then the next weight write or wake
        makes the copy again itself (``Linear.refresh_greedy_screen``); else the next greedy step does, if one comes
        (a training loop that pushes weights between sampled rollouts never pays for it)."""

    @staticmethod
    def available(kernels: ModuleType | None) -> bool:
        """Whether these kernels have the screen (AVX-512 builds with AVX512-BF16 and AVX512-VNNI)."""
        return hasattr(kernels, "pack_greedy_screen")

    def drop(self) -> None:
        """Frees the copy (sleep, or the weight's copy dropped); the split is kept, and whether greedy steps read
        it (a wake makes it again where they did)."""
        self.copy = None

    def copy_for(self, weight_copy: tuple[int, int, int, int], generation: int) -> ScreenCopy:
        """The copy for the float32 copy ``weight_copy`` (``Linear.row_block_weight()``) at ``generation``: made
        again, into the old tensors where their shapes fit, after the weight or the split changed."""
        copy = self.copy
        split = self.split
        if copy is None or copy.generation != generation or copy.split is not split:
            address, floats, out_features, stride = weight_copy
            into = (copy.packed, copy.norms) if copy is not None else (None, None)
            packed, norms = self.kernels.pack_greedy_screen(
                address, floats, out_features, self.in_features, stride, split.order, split.int8_dims, *into
            )
            copy = self.copy = ScreenCopy(packed, norms, split, generation)
            self.read_since_made = False
        return copy

    @property
    def split_chosen(self) -> bool:
        """Whether the split is chosen: ``argmax`` no longer looks at the rows it screens."""
        return self._rows_seen >= SAMPLE_ROWS

    def read_copy(self, weight_copy: tuple[int, int, int, int], generation: int) -> ScreenCopy:
        """``copy_for``, for a greedy step about to read it."""
        copy = self.copy_for(weight_copy, generation)
        self.read_since_made = True
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
        copy = self.read_copy(weight_copy, generation)
        address, floats, out_features, stride = weight_copy
        tokens = self.kernels.greedy_screen_argmax(
            x,
            copy.packed,
            copy.norms,
            copy.split.order,
            copy.split.int8_dims,
            address,
            floats,
            out_features,
            stride,
            bias,
            rows,
        )
        return tokens if tokens.numel() == x.shape[0] else None

    def _observe(self, x: torch.Tensor) -> None:
        """Keeps x's rows; at ``SAMPLE_ROWS`` rows, chooses the split from them."""
        if not bool(torch.isfinite(x).all()):
            return
        self._sample.append(x.detach().clone())
        self._rows_seen += x.shape[0]
        if self._rows_seen >= SAMPLE_ROWS:
            self.split = choose_split(torch.cat(self._sample))
            self._sample = []
