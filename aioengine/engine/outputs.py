"""What a generate() stream yields, and the incremental detokenizer that builds its text."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability at one position, as vLLM returns it."""

    logprob: float
    rank: int
    """1 for the most likely token; the chosen token's rank counts every token at least as likely."""
    decoded_token: str


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token: token id -> Logprob, the chosen token and the top k."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token likewise; the first is None (nothing precedes it)."""


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (one of its ``n`` samples); ``token_ids`` and ``text`` are
    cumulative, ``delta_*`` are new since the request's last output."""

    index: int
    token_ids: list[int]
    text: str
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """"stop" | "length" | "abort", once this sequence finished."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the sequence, if one did."""
    logprobs: SampleLogprobs | None = None
    """One entry per token of ``token_ids`` when ``SamplingParams.logprobs`` is set."""
    cumulative_logprob: float | None = None
    """Sum of the chosen tokens' logprobs (with ``logprobs`` set)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One update of a request: ``outputs`` holds each of its ``n`` sequences (vLLM's layout).

    The flat fields (``token_ids``, ``text``, ``delta_text``, ``finish_reason``, ...) are those of
    ``outputs[0]``: the whole answer when ``n == 1``.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    """Every sequence finished."""
    prompt_logprobs: PromptLogprobs | None = None
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token (given from the first output on)."""
    weights_version: int = 0
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def delta_text(self) -> str:
        return self.outputs[0].delta_text

    @property
    def delta_token_ids(self) -> list[int]:
        return self.outputs[0].delta_token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> SampleLogprobs | None:
        return self.outputs[0].logprobs

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob


@dataclass(frozen=True, slots=True)
class ScoreOutput:
    """One continuation rated by ``AsyncEngine.score``."""

    token_ids: list[int]
    """The continuation's tokens."""
    logprobs: list[float]
    """Each token's logprob given the prompt and the continuation's tokens before it."""
    ranks: list[int]
    total: float
    """The sum of ``logprobs``: the continuation's log-likelihood."""
    top_logprobs: SampleLogprobs
    """Per token: the token's own entry and the ``top_logprobs`` most likely ones."""
    weights_version: int = 0

    @staticmethod
    def of(output: CompletionOutput, weights_version: int) -> ScoreOutput:
        entries = output.logprobs or []
        own = [entry[token] for entry, token in zip(entries, output.token_ids, strict=True)]
        return ScoreOutput(
            token_ids=output.token_ids,
            logprobs=[lp.logprob for lp in own],
            ranks=[lp.rank for lp in own],
            total=sum(lp.logprob for lp in own),
            top_logprobs=entries,
            weights_version=weights_version,
        )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without ever emitting a broken UTF-8 character.

    Ids the tokenizer cannot decode (a model vocab larger than the tokenizer's) are skipped. Stop
    strings are cut from the text; text that might still become a stop string is held back, so a
    stream never shows part of one.
    """

    def __init__(self, tokenizer: Any, stop: list[str], include_stop: bool, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.vocab_limit = len(tokenizer)
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text already streamed
        self._prefix_offset = 0
        self._read_offset = 0
        # A fast tokenizer's decode is its Rust backend's plus an optional clean-up pass; without the
        # clean-up, calling the backend directly gives the same text in a third of the time.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", True) else backend

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        decoder = self._backend if self._backend is not None else self.tokenizer
        text: str = decoder.decode(ids, skip_special_tokens=self.skip_special)
        return text

    def add(self, token_ids: list[int], finished: bool) -> tuple[str, str | None]:
        """Feeds new ids; returns (delta text to stream now, the stop string hit or None)."""
        searched_from = len(self.text)
        for token in token_ids:  # one at a time: several at once would hold back the text of all of them
            if 0 <= token < self.vocab_limit:  # while the last one ends in part of a character
                self.ids.append(token)
                self._read_new()
        hit = self._find_stop(searched_from)
        end = len(self.text) if (finished or hit) else len(self.text) - self._held_back()
        delta = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return delta, hit

    def _read_new(self) -> None:
        """Adds the text of the ids since the last read, unless it ends in a broken character (then the next id
        may complete it)."""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)

    def _find_stop(self, searched_from: int) -> str | None:
        if not self.stop:
            return None
        longest = max(len(s) for s in self.stop)
        window_start = max(0, searched_from - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, window_start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s) if self.include_stop else idx]
        return s

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best


def _same_weights(a: RequestOutput, b: RequestOutput) -> bool:
    return a.weights_version == b.weights_version


@dataclass(slots=True)
class OutputCollector:
    """Hands outputs from the engine loop to one consumer; merges updates if the consumer lags.

    Merging instead of queueing keeps memory bounded for slow consumers and loses nothing:
    deltas concatenate, cumulative fields take the newest value. Outputs computed with different
    weights are never merged, so every token's ``weights_version`` stays exact (a new version is
    rare, so what waits stays small). An error ends the stream: nothing after it is kept.
    """

    _pending: deque[RequestOutput | BaseException] = field(default_factory=deque)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._pending
        last = pending[-1] if pending else None
        if isinstance(last, BaseException):
            return
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and _same_weights(last, item):
            for older, newer in zip(last.outputs, item.outputs, strict=True):
                newer.delta_text = older.delta_text + newer.delta_text
                newer.delta_token_ids = older.delta_token_ids + newer.delta_token_ids
            pending.pop()
        pending.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        item = self._pending.popleft()
        if not self._pending:
            self._ready.clear()
        if isinstance(item, BaseException):
            raise item
        return item


class RequestStream:
    """The outputs of one queued request (``AsyncEngine.submit``), as an async iterator that ends after the
    last. Closing it (``close()`` or ``aclose()``) before that aborts the request and frees its KV blocks at
    once; so does cancelling the task that waits on it, once the caller closes it (``generate`` does)."""

    def __init__(self, request_id: str, collector: OutputCollector, release: Callable[[], None]) -> None:
        self.request_id = request_id
        self._collector = collector
        self._release = release
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._collector.get()
        self._done = out.finished
        return out

    def close(self) -> None:
        """Aborts the request unless its last output was taken; idempotent."""
        if not self._done:
            self._done = True
            self._release()

    async def aclose(self) -> None:
        self.close()
