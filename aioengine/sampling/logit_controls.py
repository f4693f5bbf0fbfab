"""Logit controls of a request, vectorised over the rows that use them: allowed_token_ids, bad words and
banned ids, logit_bias, and the repetition / presence / frequency penalties. Each builder returns None when
no row of the batch uses its control, so such a batch pays nothing for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from aioengine.int_tensors import int64_tensor
from aioengine.sampling.params import SamplingParams

History = tuple[Sequence[int], int]
"""(token_ids, num_prompt_tokens): every token before the one being sampled, prompt first."""


class TokenEntries(NamedTuple):
    """Sparse entries (rows[j], cols[j]) of the batch's [B, V] logits, with a value for each."""

    rows: torch.Tensor
    """[N] int64."""
    cols: torch.Tensor
    """[N] int64."""
    values: torch.Tensor
    """[N] float32."""


class RowMask(NamedTuple):
    """A [R, V] bool mask over some rows of the batch."""

    rows: torch.Tensor
    """[R] int64, each row once."""
    mask: torch.Tensor
    """[R, V] bool."""


class Penalties(NamedTuple):
    """Repetition, presence and frequency penalties of the rows that set any of them."""

    rows: torch.Tensor
    """[R] int64, each row once."""
    output_counts: torch.Tensor
    """[R, V] float32: how often the token occurs in the output."""
    repetition: torch.Tensor | None
    """[R, 1] float32, 1 = off; None when every row is off (likewise below)."""
    seen: torch.Tensor | None
    """[R, V] bool: the token occurs in the prompt or the output; None with ``repetition``."""
    presence: torch.Tensor | None
    """[R, 1] float32, 0 = off."""
    frequency: torch.Tensor | None
    """[R, 1] float32, 0 = off."""


def _check_ids(what: str, row: int, ids: Sequence[int], vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"row {row}: {what} holds token ids outside [0, {vocab_size}): {list(ids)}")


def _history(histories: Sequence[History | None], row: int) -> History:
    history = histories[row]
    if history is None:
        raise ValueError(f"row {row} uses penalties or bad words but has no history; pass histories[{row}]")
    return history


def build_disallowed(params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str) -> RowMask | None:
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
    for j, i in enumerate(rows):
        allowed = params[i].allowed_token_ids
        assert allowed is not None
        _check_ids("allowed_token_ids", i, allowed, vocab_size)
        mask[j, int64_tensor(allowed, device)] = False
    return RowMask(int64_tensor(rows, device), mask)


def _bad_word_bans(params: SamplingParams, history: History) -> list[int]:
    """The last token of every bad-word sequence whose other tokens end the output (vLLM: output only)."""
    token_ids, num_prompt_tokens = history
    output = list(token_ids[num_prompt_tokens:])
    bans = []
    for seq in params.bad_words_token_ids:
        prefix = len(seq) - 1
        if prefix <= len(output) and output[len(output) - prefix :] == seq[:prefix]:
            bans.append(seq[-1])
    return bans


def build_banned(
    params: Sequence[SamplingParams],
    histories: Sequence[History | None],
    banned: Sequence[Sequence[int] | None],
    vocab_size: int,
    device: torch.device | str,
) -> TokenEntries | None:
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(params):
        ids = list(banned[i] or [])
        _check_ids("banned", i, ids, vocab_size)
        if p.bad_words_token_ids:
            bans = _bad_word_bans(p, _history(histories, i))
            _check_ids("bad_words_token_ids", i, bans, vocab_size)
            ids += bans
        rows += [i] * len(ids)
        cols += ids
    if not rows:
        return None
    values = torch.full((len(rows),), float("-inf"), dtype=torch.float32, device=device)
    return TokenEntries(int64_tensor(rows, device), int64_tensor(cols, device), values)


def build_logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
) -> TokenEntries | None:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            _check_ids("logit_bias", i, list(p.logit_bias), vocab_size)
            rows += [i] * len(p.logit_bias)
            cols += p.logit_bias.keys()
            values += p.logit_bias.values()
    if not rows:
        return None
    return TokenEntries(int64_tensor(rows, device), int64_tensor(cols, device), torch.tensor(values, device=device))


def build_penalties(
    params: Sequence[SamplingParams],
    histories: Sequence[History | None],
    vocab_size: int,
    device: torch.device | str,
) -> Penalties | None:
    rows = [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    ]
    if not rows:
        return None
    prompts: list[Sequence[int]] = []
    outputs: list[Sequence[int]] = []
    for i in rows:
        token_ids, num_prompt_tokens = _history(histories, i)
        prompts.append(token_ids[:num_prompt_tokens])
        outputs.append(token_ids[num_prompt_tokens:])
    output_counts = _token_counts(outputs, vocab_size, device)
    repetition = _column([params[i].repetition_penalty for i in rows], 1.0, device)
    seen = None
    if repetition is not None:
        seen = (output_counts > 0) | (_token_counts(prompts, vocab_size, device) > 0)
    return Penalties(
        rows=int64_tensor(rows, device),
        output_counts=output_counts,
        repetition=repetition,
        seen=seen,
        presence=_column([params[i].presence_penalty for i in rows], 0.0, device),
        frequency=_column([params[i].frequency_penalty for i in rows], 0.0, device),
    )


def _column(values: list[float], off: float, device: torch.device | str) -> torch.Tensor | None:
    """[R, 1] float32 of ``values``; None when all are ``off``."""
    if all(v == off for v in values):
        return None
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _token_counts(seqs: list[Sequence[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[len(seqs), V] float32: how often each token occurs in each sequence; ids >= V are ignored (as HF does)."""
    width = max(len(s) for s in seqs)
    # Padding and out-of-vocabulary ids land in an extra column that is dropped.
    padded = [t for s in seqs for t in (*s, *[vocab_size] * (width - len(s)))]
    ids = int64_tensor(padded, device).reshape(len(seqs), width).clamp_(max=vocab_size)
    counts = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_logit_controls(
    logits: torch.Tensor,
    disallowed: RowMask | None,
    banned: TokenEntries | None,
    logit_bias: TokenEntries | None,
    penalties: Penalties | None,
) -> torch.Tensor:
    """Apply, in vLLM's order, allowed_token_ids, bans (bad words, ``banned``), logit_bias and penalties.

    Returns ``logits`` itself when no row has one of these, else a new float32 tensor; the rows
    without any are copied unchanged.
    """
    if disallowed is None and banned is None and logit_bias is None and penalties is None:
        return logits
    out = logits.to(torch.float32, copy=True)
    if disallowed is not None:
        rows, mask = disallowed
        out[rows] = out[rows].masked_fill(mask, float("-inf"))
    if banned is not None:
        out.index_put_((banned.rows, banned.cols), banned.values)
    if logit_bias is not None:
        out.index_put_((logit_bias.rows, logit_bias.cols), logit_bias.values, accumulate=True)
    if penalties is not None:
        out[penalties.rows] = apply_penalties(out[penalties.rows], penalties)
    return out


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """[R, V] logits of ``p.rows`` -> penalised: repetition (HF) over prompt and output, then frequency and
    presence (OpenAI) over the output. Returns a new tensor (``logits`` itself when every penalty is off)."""
    out = logits
    if p.repetition is not None and p.seen is not None:
        repeated = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
        out = torch.where(p.seen, repeated, logits)
    if p.frequency is not None:
        out = out - p.frequency * p.output_counts
    if p.presence is not None:
        out = out - p.presence * (p.output_counts > 0)
    return out
