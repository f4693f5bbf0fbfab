"""Turns a step's logits into one token per row: plain tensor functions, no vocabulary loops."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from aioengine.int_tensors import int64_tensor
from aioengine.sampling.logit_controls import (
    History,
    Penalties,
    RowMask,
    TokenEntries,
    apply_logit_controls,
    build_banned,
    build_disallowed,
    build_logit_bias,
    build_penalties,
)
from aioengine.sampling.params import SamplingParams, plain_greedy

_MASK64 = (1 << 64) - 1
_T = TypeVar("_T")


def _splitmix64(x: int) -> int:
    """One step of splitmix64: a cheap, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, output_index: int, sample_index: int = 0) -> int:
    """The 63-bit generator seed for the token at ``output_index`` of sample ``sample_index`` of request ``seed``.

    Keyed by position rather than by a generator carried across steps, so a preempted and
    recomputed request draws the same tokens, and nothing else in the batch can shift them.
    Sample 0 draws what a request with n == 1 draws; each other index gets its own stream.
    """
    key = _splitmix64(seed & _MASK64)
    if sample_index:
        key = _splitmix64(key ^ _splitmix64(sample_index & _MASK64))
    return _splitmix64(key ^ output_index) >> 1


@dataclass(slots=True)
class SamplingMetadata:
    """The batch's sampling parameters as tensors on the model's device; a control no row uses is None."""

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
    min_p: torch.Tensor | None = None
    """[B] float32, 0 = off (greedy rows too); None when every row is off."""
    disallowed: RowMask | None = None
    """True for the tokens outside the row's allowed_token_ids."""
    banned: TokenEntries | None = None
    """Tokens the row may not pick this step (bad words, ``banned``); values -inf."""
    logit_bias: TokenEntries | None = None
    penalties: Penalties | None = None
    return_processed: bool = False
    """Whether the sampler also returns the logits it picked from."""

    @property
    def argmax_only(self) -> bool:
        """Whether every row's token is the argmax of its raw logits: all greedy, no logit control, no
        processed logits returned (a model can then pick them without the logits: ``greedy_tokens``)."""
        controls = (self.disallowed, self.banned, self.logit_bias, self.penalties)
        return self.all_greedy and not self.return_processed and all(c is None for c in controls)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        device: torch.device | str,
        *,
        vocab_size: int,
        sample_indices: Sequence[int] | None = None,
        histories: Sequence[History | None] | None = None,
        banned: Sequence[Sequence[int] | None] | None = None,
        processed: bool = False,
    ) -> SamplingMetadata:
        """Pack one step's rows; ``output_indices[i]``: tokens row ``i`` generated before this step.

        ``sample_indices[i]``: the row's index among its request's n samples (default 0).
        ``histories[i]``: the row's ``History``, needed where ``params[i].uses_history``.
        ``banned[i]``: token ids the row may not pick (EOS and stop ids before min_tokens).
        ``processed``: return the processed logits (some row wants logprobs_mode "processed").
        A seeded row's generator is seeded from ``row_seed(seed, output_index, sample_index)``, so
        its token depends only on (seed, output position, sample index, logits).
        """
        rows = len(params)
        sample_indices = _per_row("sample_indices", sample_indices, rows, 0)
        histories = _per_row("histories", histories, rows, None)
        banned = _per_row("banned", banned, rows, None)
        _per_row("output indices", output_indices, rows, 0)
        if rows and not any(banned) and all(plain_greedy(p) for p in params):
            # What the general path below makes of such rows, without its dozen passes over them (a decode step's
            # 64 rows paid ~60 us there): every control None, temperatures 0.
            return cls(
                temperature=torch.zeros(rows, dtype=torch.float32, device=device),
                top_k=None,
                top_p=None,
                all_greedy=True,
                all_random=False,
                generators={},
                return_processed=processed,
            )
        greedy = [p.is_greedy for p in params]
        # Greedy rows ignore min-p / top-k / top-p, so they never force that work on the batch.
        top_ks = [0 if g else p.top_k for p, g in zip(params, greedy, strict=True)]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        generators: dict[int, torch.Generator] = {}
        for i, (p, g) in enumerate(zip(params, greedy, strict=True)):
            if p.seed is not None and not g:
                gen = torch.Generator(device=device)
                gen.manual_seed(row_seed(p.seed, output_indices[i], sample_indices[i]))
                generators[i] = gen
        return cls(
            temperature=torch.tensor(
                [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                dtype=torch.float32,
                device=device,
            ),
            top_k=int64_tensor(top_ks, device) if any(top_ks) else None,
            top_p=(torch.tensor(top_ps, dtype=torch.float32, device=device) if any(p < 1.0 for p in top_ps) else None),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            generators=generators,
            min_p=torch.tensor(min_ps, dtype=torch.float32, device=device) if any(min_ps) else None,
            disallowed=build_disallowed(params, vocab_size, device),
            banned=build_banned(params, histories, banned, vocab_size, device),
            logit_bias=build_logit_bias(params, vocab_size, device),
            penalties=build_penalties(params, histories, vocab_size, device),
            return_processed=processed,
        )


def _per_row(name: str, values: Sequence[_T] | None, rows: int, default: _T) -> Sequence[_T]:
    """``values``, checked to hold one entry per row; ``[default] * rows`` when None."""
    if values is None:
        return [default] * rows
    if len(values) != rows:
        raise ValueError(f"got {rows} SamplingParams but {len(values)} {name}; pass one per row")
    return values


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit whose probability is below ``min_p`` times the row's top probability.

    Returns a new tensor (``logits`` itself when ``min_p`` is None); the top token always stays.
    """
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


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


def inverse_cdf(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from ``probs`` by inverse transform: the first token whose cumulative
    probability exceeds u * total, u ~ U[0, 1) (a seeded row's u from its own generator).

    One uniform per row, not one random number per vocabulary entry as an exponential race (argmax of
    probs / q, q ~ Exp(1)) would draw: for a [256, 32k] batch on 2 CPU cores ~10 ms instead of ~0.3 s.
    No host sync either. The sum runs in float64, so a large vocabulary adds no rounding bias.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    for row, gen in generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=gen)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One step's sampled tokens, and the logits they were picked from when asked for."""

    token_ids: torch.Tensor
    """[B] int64."""
    processed_logits: torch.Tensor | None
    """[B, V] float32 when ``meta.return_processed``: greedy rows after the logit controls, random rows
    also after temperature, min-p, top-k and top-p (dropped tokens -inf). May share memory with ``logits``
    where nothing changed them."""


class Sampler:
    """Picks the next token of every row: greedy rows by argmax, random rows by sampling.

    Both first go through the logit controls (``apply_logit_controls``); greedy rows then ignore
    temperature, min-p, top-k and top-p. ``argmax`` ([B, V] float32 -> [B] int64, first maximum of each
    row) replaces ``torch.argmax`` for greedy rows of float32 logits: the CPU kernel of ``cpu_kernels``
    is several times faster.
    """

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.argmax = argmax

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """[B, V] logits -> [B] int64 token ids (and the processed logits). ``logits`` is never modified."""
        controlled = apply_logit_controls(logits, meta.disallowed, meta.banned, meta.logit_bias, meta.penalties)
        argmax = self.argmax if self.argmax is not None and controlled.dtype == torch.float32 else _torch_argmax
        # float32 holds bf16/fp16 exactly, so argmax on the raw logits equals argmax in float32.
        greedy_tokens = None if meta.all_random else argmax(controlled)
        if meta.all_greedy:
            assert greedy_tokens is not None
            return SamplerOutput(greedy_tokens, controlled.float() if meta.return_processed else None)
        temperature = meta.temperature
        is_greedy = temperature == 0
        # Greedy rows are sampled too (and then discarded); give them a harmless temperature.
        if not meta.all_random:
            temperature = temperature.masked_fill(is_greedy, 1.0)
        scaled = controlled.float() / temperature.unsqueeze(1)  # a new tensor: input untouched
        scaled = apply_min_p(scaled, meta.min_p)
        scaled = apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
        sampled = inverse_cdf(scaled.softmax(dim=-1), meta.generators)
        if greedy_tokens is None:
            return SamplerOutput(sampled, scaled if meta.return_processed else None)
        tokens = torch.where(is_greedy, greedy_tokens, sampled)
        if not meta.return_processed:
            return SamplerOutput(tokens, None)
        return SamplerOutput(tokens, torch.where(is_greedy.unsqueeze(1), controlled.float(), scaled))


def gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, V] logprobs, [R] chosen ids -> (ids, values, ranks), each [R, 1 + k].

    Column 0 is the chosen token, then the k most likely in descending order with ranks 1..k.
    The chosen token's rank counts the entries with a logprob >= its own (vLLM's rank).
    """
    if not 0 <= k <= logprobs.shape[-1]:
        raise ValueError(f"k must be in [0, {logprobs.shape[-1]}] (the vocabulary size), got {k}")
    chosen = chosen.to(torch.int64).unsqueeze(1)
    chosen_values = logprobs.gather(1, chosen)
    chosen_ranks = (logprobs >= chosen_values).sum(dim=-1, keepdim=True)
    top_values, top_ids = logprobs.topk(k, dim=-1)
    top_ranks = torch.arange(1, k + 1, device=logprobs.device).expand(logprobs.shape[0], k)
    return (
        torch.cat([chosen, top_ids], dim=1),
        torch.cat([chosen_values, top_values], dim=1),
        torch.cat([chosen_ranks, top_ranks], dim=1),
    )
