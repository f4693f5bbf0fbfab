"""Turns a step's logits into one token per row: plain tensor functions, no vocabulary loops."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from aioengine.sampling.params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of splitmix64: a cheap, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, output_index: int) -> int:
    """The 63-bit generator seed for the token at ``output_index`` of a request seeded ``seed``.

    Keyed by position rather than by a generator carried across steps, so a preempted and
    recomputed request draws the same tokens, and nothing else in the batch can shift them.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ output_index) >> 1


@dataclass(slots=True)
class SamplingMetadata:
    """The batch's sampling parameters as tensors on the model's device."""

    temperature: torch.Tensor
    """[B] float32, 0 for greedy rows."""
    top_k: torch.Tensor | None
    """[B] int64, 0 = off; None when every row is off."""
    top_p: torch.Tensor | None
    """[B] float32; None when every row is 1.0."""
    all_greedy: bool
    all_random: bool
    generators: dict[int, torch.Generator]
    """Row index -> generator, for seeded random rows only."""

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Pack one step's rows; ``output_indices[i]``: tokens row ``i`` generated before this step.

        A seeded row's generator is seeded from ``row_seed(seed, output_index)``, so its token
        depends only on (seed, output position, logits).
        """
        if len(params) != len(output_indices):
            raise ValueError(
                f"got {len(params)} SamplingParams but {len(output_indices)} output indices; "
                "pass one output index per row"
            )
        greedy = [p.is_greedy for p in params]
        # Greedy rows ignore top-k / top-p, so they never force that work on the batch.
        top_ks = [0 if g else p.top_k for p, g in zip(params, greedy, strict=True)]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        generators: dict[int, torch.Generator] = {}
        for i, (p, g) in enumerate(zip(params, greedy, strict=True)):
            if p.seed is not None and not g:
                gen = torch.Generator(device=device)
                gen.manual_seed(row_seed(p.seed, output_indices[i]))
                generators[i] = gen
        return cls(
            temperature=torch.tensor(
                [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                dtype=torch.float32,
                device=device,
            ),
            top_k=torch.tensor(top_ks, dtype=torch.int64, device=device) if any(top_ks) else None,
            top_p=(torch.tensor(top_ps, dtype=torch.float32, device=device) if any(p < 1.0 for p in top_ps) else None),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            generators=generators,
        )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and then outside its top-p nucleus.

    Returns a new tensor; ``logits`` itself is not changed. One ascending sort serves both.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k).clamp(max=vocab)
        kth_largest = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))  # ties keep extra
    if top_p is not None:
        # A token is needed iff the mass strictly above it is < p, i.e. the mass at or
        # below it (ascending cumsum) is > 1 - p.
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from ``probs``: argmax(probs / q), q ~ Exponential(1).

    Equivalent to a categorical draw, but with no host sync (unlike torch.multinomial) and
    with each seeded row's noise taken from its own generator.
    """
    q = torch.empty_like(probs).exponential_()
    for row, gen in generators.items():
        q[row] = torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=gen)
    # q == 0 would give 0/0 = NaN for zero-probability tokens, and argmax picks NaN.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


class Sampler:
    """Picks the next token of every row: greedy rows by argmax, random rows by sampling.

    ``argmax`` ([B, V] float32 -> [B] int64, first maximum of each row) replaces ``torch.argmax`` for
    greedy rows of float32 logits: the CPU kernel of ``cpu_kernels`` is several times faster.
    """

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.argmax = argmax

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """[B, V] logits -> [B] int64 token ids. ``logits`` is never modified."""
        argmax = self.argmax if self.argmax is not None and logits.dtype == torch.float32 else _torch_argmax
        # float32 holds bf16/fp16 exactly, so argmax on the raw logits equals argmax in float32.
        greedy_tokens = None if meta.all_random else argmax(logits)
        if meta.all_greedy:
            assert greedy_tokens is not None
            return greedy_tokens
        temperature = meta.temperature
        is_greedy = temperature == 0
        # Greedy rows are sampled too (and then discarded); give them a harmless temperature.
        if not meta.all_random:
            temperature = temperature.masked_fill(is_greedy, 1.0)
        scaled = logits.float() / temperature.unsqueeze(1)  # a new tensor: input untouched
        scaled = apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
        sampled = exponential_race(scaled.softmax(dim=-1), meta.generators)
        if greedy_tokens is None:
            return sampled
        return torch.where(is_greedy, greedy_tokens, sampled)
