"""The output side of one submitted request: its stream, and per sequence the text and logprobs so far.

A request is one or more sequences (its ``n`` samples, or the continuations ``score`` rates), each a
scheduler ``Request`` with the request's id as ``group_id`` and its place as ``sample_index``. The
engine core keeps one ``RequestState`` per submitted id and feeds it the steps' updates; it builds
one ``RequestOutput`` per step for the whole request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from aioengine.engine.outputs import (
    CompletionOutput,
    IncrementalDetokenizer,
    Logprob,
    OutputCollector,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from aioengine.messages import LogprobRows
from aioengine.scheduler.request import Request

RequestKind = Literal["generate", "score"]
""""generate": sequences sample tokens and stream them; "score": sequences are the prompt followed by a
given continuation, and the one output (at the end) holds the continuation tokens' logprobs."""

TokenText = Callable[[int], str]


def logprob_dict(token_ids: list[int], logprobs: list[float], ranks: list[int], text: TokenText) -> dict[int, Logprob]:
    """One position's row as vLLM shows it: token id -> Logprob, the chosen token first."""
    return {t: Logprob(lp, rank, text(t)) for t, lp, rank in zip(token_ids, logprobs, ranks, strict=True)}


@dataclass(slots=True)
class SampleState:
    """One sequence's output so far, and what it gained since the request's last output."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    """None where the request asked for no text (``detokenize=False``)."""
    logprobs: SampleLogprobs | None
    cumulative_logprob: float = 0.0
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


class RequestState:
    """The stream of one submitted request and the output state of each of its sequences."""

    def __init__(
        self,
        sequences: list[Request],
        detokenizers: list[IncrementalDetokenizer | None],
        token_text: TokenText,
        kind: RequestKind = "generate",
        num_scored_from: int = 0,
    ) -> None:
        leader = sequences[0]
        self.request_id = leader.group_id
        self.kind: RequestKind = kind
        self.prompt_token_ids = (
            leader.prompt_token_ids[:num_scored_from] if kind == "score" else leader.prompt_token_ids
        )
        self.num_scored_from = num_scored_from
        """For "score": where the continuations begin in each sequence's tokens."""
        keep = leader.sampling.logprobs is not None
        self.final_only = kind == "score" or leader.sampling.output_kind == "final_only"
        """One output, once every sequence ended (a score's is always so)."""
        self.samples = [
            SampleState(request, detok, [] if keep else None)
            for request, detok in zip(sequences, detokenizers, strict=True)
        ]
        self.collector = OutputCollector()
        self.token_text = token_text
        self._prompt_logprobs: PromptLogprobs | None = None

    @property
    def sequences(self) -> list[Request]:
        return [s.request for s in self.samples]

    @property
    def finished(self) -> bool:
        samples = self.samples
        if len(samples) == 1:  # most requests; read for each request a step touches
            return samples[0].request.status.is_finished
        return all(s.request.status.is_finished for s in samples)

    def add(self, request: Request, token_ids: list[int], finished: bool, rows: LogprobRows | None) -> str | None:
        """Takes one step's tokens of a sequence; returns the stop string they completed, if any."""
        sample = self.samples[request.sample_index]
        hit = None
        if sample.detokenizer is not None:
            delta, hit = sample.detokenizer.add(token_ids, finished)
            sample.delta_text += delta
        sample.delta_token_ids += token_ids
        if rows is not None and sample.logprobs is not None:
            for ids, lps, ranks in zip(rows.token_ids, rows.logprobs, rows.ranks, strict=True):
                sample.logprobs.append(logprob_dict(ids, lps, ranks, self.token_text))
                sample.cumulative_logprob += lps[0]
        return hit

    def output(self, weights_version: int) -> RequestOutput:
        """The request as it stands, with every sequence's gains since the last output (then cleared)."""
        if self.kind == "score":
            return self._score_output(weights_version)
        outputs = []
        for sample in self.samples:
            request = sample.request
            outputs.append(
                CompletionOutput(
                    index=request.sample_index,
                    token_ids=request.output_token_ids,
                    text=sample.detokenizer.text if sample.detokenizer is not None else "",
                    delta_text=sample.delta_text,
                    delta_token_ids=sample.delta_token_ids,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                    cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
                )
            )
            sample.delta_text = ""
            sample.delta_token_ids = []
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs(),
            weights_version=weights_version,
            num_preemptions=sum(s.request.num_preemptions for s in self.samples),
        )

    def prompt_logprobs(self) -> PromptLogprobs | None:
        """The leader's prompt logprobs, once every prompt token has them (None until then, or if not asked)."""
        if self._prompt_logprobs is None:
            leader = self.samples[0].request
            rows = leader.prompt_logprobs
            if leader.prompt_logprobs_from is None or len(rows) < leader.num_prompt_tokens - 1:
                return None
            entries: PromptLogprobs = [None]
            entries += [logprob_dict(*rows[pos], self.token_text) for pos in range(1, leader.num_prompt_tokens)]
            self._prompt_logprobs = entries
        return self._prompt_logprobs

    def _score_output(self, weights_version: int) -> RequestOutput:
        """Each continuation as a CompletionOutput: its tokens, their logprobs and the sum."""
        outputs = []
        start = self.num_scored_from
        for sample in self.samples:
            request = sample.request
            end = request.num_prompt_tokens
            scored = [request.prompt_logprobs.get(pos) for pos in range(start, end)]
            complete = all(row is not None for row in scored)
            logprobs = [logprob_dict(*row, self.token_text) for row in scored if row is not None]
            outputs.append(
                CompletionOutput(
                    index=request.sample_index,
                    token_ids=request.prompt_token_ids[start:],
                    text="",
                    finish_reason=request.finish_reason if complete else "abort",
                    logprobs=logprobs,
                    cumulative_logprob=sum(row[1][0] for row in scored if row is not None),
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            weights_version=weights_version,
            num_preemptions=sum(s.request.num_preemptions for s in self.samples),
        )
