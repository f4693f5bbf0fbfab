"""Logprobs in OpenAI's two layouts: the legacy completions lists and chat's per-token objects.

JSON has no -inf: a token the sampler could not draw (masked, or outside top-k / top-p in "processed" mode)
reports ``MIN_LOGPROB``, as vLLM does. A completion's ``top_logprobs`` map the k most likely tokens and the
chosen one (vLLM's layout: ``logprobs=0`` gives the chosen token alone); chat's list the k most likely
(rank <= k), which hold the chosen token only when it is one of them, as OpenAI's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aioengine.engine.outputs import Logprob
from aioengine.server.protocol import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

MIN_LOGPROB = -9999.0
"""JSON has no -inf: a token the sampler could not draw (masked, or outside top-k / top-p in "processed"
mode) reports this, as vLLM does."""


def clamp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= k), key=lambda item: item[1].rank)


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(token_ids), skip_special_tokens=True))


def prompt_part(
    into: CompletionLogprobs,
    entries: Sequence[dict[int, Logprob] | None],
    prompt_ids: Sequence[int],
    prompt_text: str,
    k: int,
    tokenizer: Any,
) -> None:
    """The echoed prompt's tokens. Special tokens (BOS) are listed but take no room in the echoed text, so each
    offset points into ``text``; offsets never pass the prompt's end (a token's own text may differ slightly
    from its share of the whole decoded prompt)."""
    extend(into, entries, prompt_ids, k, tokenizer, 0, frozenset(tokenizer.all_special_ids), len(prompt_text))


def extend(
    into: CompletionLogprobs,
    entries: Sequence[dict[int, Logprob] | None],
    token_ids: Sequence[int],
    k: int,
    tokenizer: Any,
    offset: int,
    unprinted: frozenset[int] = frozenset(),
    limit: int | None = None,
) -> None:
    """Appends the legacy layout's parallel lists for ``token_ids``, text offsets counted from ``offset``
    (tokens in ``unprinted`` take no room; no offset passes ``limit``)."""
    for entry, token in zip(entries, token_ids, strict=False):
        chosen = entry.get(token) if entry is not None else None
        text = chosen.decoded_token if chosen is not None else tokenizer.decode([token])
        into.tokens.append(text)
        into.token_logprobs.append(clamp(chosen.logprob) if chosen is not None else None)
        into.top_logprobs.append(
            {lp.decoded_token: clamp(lp.logprob) for lp in sorted(entry.values(), key=lambda lp: lp.rank)}
            if entry is not None
            else None
        )
        into.text_offset.append(offset if limit is None else min(offset, limit))
        offset += 0 if token in unprinted else len(text)


def chat_logprobs(entries: Sequence[dict[int, Logprob]] | None, token_ids: Sequence[int], k: int) -> ChoiceLogprobs:
    content = []
    for entry, token in zip(entries or [], token_ids, strict=False):
        chosen = entry[token]
        top = [
            TopLogprob(token=lp.decoded_token, logprob=clamp(lp.logprob), bytes=list(lp.decoded_token.encode()))
            for _, lp in top_entries(entry, k)
        ]
        content.append(
            TokenLogprob(
                token=chosen.decoded_token,
                logprob=clamp(chosen.logprob),
                bytes=list(chosen.decoded_token.encode()),
                top_logprobs=top,
            )
        )
    return ChoiceLogprobs(content=content)
