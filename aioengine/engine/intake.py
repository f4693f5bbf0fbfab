"""What a caller submits, turned into scheduler requests: prompts to token ids, every field checked.

All refusals raise ``InvalidRequestError`` (a ``ValueError``; ``RequestTooLargeError`` for lengths)
naming the request and the field, before anything is queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from aioengine.config import TokenizerMode
from aioengine.engine import tokenizer as tokenization
from aioengine.errors import InvalidRequestError, RequestTooLargeError
from aioengine.messages import ModelInfo
from aioengine.sampling.params import SamplingParams
from aioengine.scheduler.request import Request
from aioengine.scheduler.scheduler import Scheduler

Prompt = str | Sequence[int]
ChatMessages = Sequence[Mapping[str, str]]
"""A conversation: ``[{"role": "system" | "user" | "assistant", "content": "..."}, ...]``."""

LONG_PROMPT_CHARS = 16_384
"""Text prompts longer than this are tokenized on a thread, so the event loop keeps serving meanwhile."""

SCORE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
"""A scored sequence computes its tokens and stops: the one argmax after them is thrown away."""


async def prompt_ids(
    tokenizer: Any, prompt: Prompt, request_id: str, max_token_bytes: int, max_model_len: int
) -> list[int]:
    """Token ids of a prompt. A text that must be longer than ``max_model_len`` whatever it says is refused
    before it is tokenized (no token covers more than ``max_token_bytes`` bytes); a long one is tokenized
    off the event loop."""
    if not isinstance(prompt, str):
        return list(prompt)
    if not prompt:
        return []
    at_least = len(prompt.encode()) // max_token_bytes
    if at_least > max_model_len:
        raise RequestTooLargeError(
            f"request {request_id!r}: the prompt ({len(prompt)} characters) is at least {at_least} tokens, "
            f"more than max_model_len={max_model_len}; shorten it"
        )
    if len(prompt) <= LONG_PROMPT_CHARS:
        ids: list[int] = tokenizer(prompt).input_ids
    else:
        ids = (await asyncio.to_thread(tokenizer, prompt)).input_ids
    return ids


async def continuation_ids(tokenizer: Any, continuation: Prompt, request_id: str, index: int) -> list[int]:
    """A continuation's token ids: a text is tokenized on its own, without special tokens (token ids say
    exactly which tokens to rate; a text's tokens next to the prompt's may differ from joint tokenization)."""
    if not isinstance(continuation, str):
        ids = list(continuation)
    elif len(continuation) <= LONG_PROMPT_CHARS:
        ids = tokenizer(continuation, add_special_tokens=False).input_ids
    else:
        ids = (await asyncio.to_thread(tokenizer, continuation, add_special_tokens=False)).input_ids
    if not ids:
        raise InvalidRequestError(f"request {request_id!r}: continuation {index} is empty")
    return ids


async def chat_ids(tokenizer: Any, messages: ChatMessages, request_id: str) -> list[int]:
    """The prompt of a conversation (``apply_chat_template``), off the event loop when it is long."""
    if sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, Mapping)) <= LONG_PROMPT_CHARS:
        return apply_chat_template(tokenizer, messages, request_id)
    return await asyncio.to_thread(apply_chat_template, tokenizer, messages, request_id)


def check_params(
    params: SamplingParams, request_id: str, info: ModelInfo, max_num_seqs: int, max_logprobs: int, tokenizer: Any
) -> SamplingParams:
    """The limits a ``SamplingParams`` cannot know alone (the model's vocabulary, the engine's config);
    ``bad_words`` become token sequences. Returns the params to run."""
    where = f"request {request_id!r}"
    if params.n > max_num_seqs:
        raise InvalidRequestError(
            f"{where}: n={params.n} is more than scheduler.max_num_seqs={max_num_seqs}, the most sequences a "
            "step runs; lower n or raise max_num_seqs"
        )
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > max_logprobs:
            raise InvalidRequestError(
                f"{where}: {name}={k} is more than model.max_logprobs={max_logprobs}; ask for fewer or raise that limit"
            )
    vocab = info.vocab_size
    bad = next((t for t in params.token_ids_used() if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError(
            f"{where}: token id {bad} (in logit_bias, allowed_token_ids or bad_words_token_ids) is outside the "
            f"vocabulary [0, {vocab})"
        )
    if not params.bad_words:
        return params
    sequences = [list(s) for s in params.bad_words_token_ids]
    for word in params.bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):  # as the first word and after a space
            ids = [int(t) for t in tokenizer(text, add_special_tokens=False).input_ids]
            if ids and ids not in sequences:
                sequences.append(ids)
    return params.model_copy(update={"bad_words": [], "bad_words_token_ids": sequences})


def check_sequence(
    token_ids: list[int], new_tokens: int, request_id: str, info: ModelInfo, scheduler: Scheduler
) -> None:
    """A sequence of ``token_ids`` that grows by ``new_tokens``: non-empty, in the vocabulary, and one that
    fits the model, the step and the KV cache."""
    if not token_ids:
        raise InvalidRequestError(f"request {request_id!r}: the prompt is empty")
    vocab = info.vocab_size
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(
            f"request {request_id!r}: prompt token id {bad!r} is outside the vocabulary [0, {vocab})"
        )
    total = len(token_ids) + new_tokens
    if total > info.max_model_len:
        raise RequestTooLargeError(
            f"request {request_id!r}: prompt ({len(token_ids)} tokens) + max_tokens ({new_tokens}) = "
            f"{total} exceeds max_model_len={info.max_model_len}; shorten the prompt or lower max_tokens"
        )
    if not scheduler.enable_chunked_prefill and len(token_ids) > scheduler.max_num_batched_tokens:
        raise RequestTooLargeError(
            f"request {request_id!r}: the prompt ({len(token_ids)} tokens) can never be scheduled: with chunked "
            f"prefill off a prompt must fit in one step, scheduler.max_num_batched_tokens="
            f"{scheduler.max_num_batched_tokens}; shorten it, raise that limit or enable chunked prefill"
        )
    capacity = scheduler.kv.capacity_tokens
    if total > capacity:
        raise RequestTooLargeError(
            f"request {request_id!r}: needs {total} tokens of KV cache but the whole cache holds {capacity}; "
            "lower max_tokens or give the cache more memory"
        )


def sequence_id(request_id: str, index: int, count: int) -> str:
    """The scheduler's id of sequence ``index`` of ``count``: the request's own id when it is alone."""
    return request_id if count == 1 else f"{index}_{request_id}"


def generation_request(
    token_ids: list[int], params: SamplingParams, request_id: str, cache_salt: str | None = None
) -> Request:
    """The leader of a request's ``params.n`` sequences, the others parked on it: they share the prompt
    but its last token."""
    n = params.n
    leader = Request(sequence_id(request_id, 0, n), token_ids, params, group_id=request_id, cache_salt=cache_salt)
    leader.num_shared_tokens = len(token_ids) - 1
    if params.prompt_logprobs is not None:
        leader.prompt_logprobs_from = 1
        leader.prompt_logprobs_k = params.prompt_logprobs
    leader.followers = [
        Request(
            sequence_id(request_id, i, n),
            list(token_ids),
            params,
            group_id=request_id,
            sample_index=i,
            cache_salt=cache_salt,
        )
        for i in range(1, n)
    ]
    return leader


def score_request(prompt: list[int], continuations: list[list[int]], top_logprobs: int, request_id: str) -> Request:
    """One sequence per continuation (prompt + continuation), each rating its continuation's tokens; they
    share the prompt but its last token."""
    count = len(continuations)
    sequences = []
    for i, continuation in enumerate(continuations):
        request = Request(
            sequence_id(request_id, i, count), prompt + continuation, SCORE_PARAMS, group_id=request_id, sample_index=i
        )
        request.prompt_logprobs_from = len(prompt)
        request.prompt_logprobs_k = top_logprobs
        sequences.append(request)
    leader, *followers = sequences
    leader.num_shared_tokens = len(prompt) - 1
    leader.followers = followers
    return leader


def apply_chat_template(tokenizer: Any, messages: ChatMessages, request_id: str | None = None) -> list[int]:
    """``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` as a list of ids
    (transformers 5 returns a BatchEncoding, 4.x a list), with malformed input refused by name."""
    where = f"request {request_id!r}: " if request_id is not None else ""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError(f"{where}messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{where}messages[{i}] is a {type(message).__name__}, not a dict")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidRequestError(f"{where}messages[{i}] needs a string {key!r}, got {message.get(key)!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            f"{where}this model's tokenizer has no chat template, so it cannot take messages; pass a prompt instead"
        )
    try:
        encoded = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # the template's own checks (e.g. roles that must alternate) raise what they like
        raise InvalidRequestError(f"{where}the chat template refused these messages: {exc}") from exc
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded  # BatchEncoding is a Mapping
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


def load_tokenizer(path: str, mode: TokenizerMode = "auto") -> tuple[Any, int]:
    """The checkpoint's tokenizer (``aioengine.engine.tokenizer.load``: the native one where it can be) and the
    UTF-8 length of its longest token."""
    tokenizer = tokenization.load(path, mode)
    longest = max((len(token.encode()) for token in tokenizer.get_vocab()), default=1)
    return tokenizer, max(longest, 1)
