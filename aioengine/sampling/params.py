"""Per-request sampling parameters: the pydantic edge where user input is checked."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

GREEDY_EPSILON = 1e-5
"""Temperatures below this are treated as greedy: dividing logits by them overflows."""

LogprobsMode = Literal["raw", "processed"]
"""Which logits the returned logprobs are a log-softmax of: "raw", the model's own (float32); "processed",
those the token was drawn from (after logit bias, masks, penalties, temperature, min-p, top-k and top-p)."""

OutputKind = Literal["stream", "final_only"]
"""What a request's stream yields: "stream", an output at every step that adds tokens (the tokens and text so far,
and those since the last output); "final_only", one output once the request ends (vLLM's
``RequestOutputKind.FINAL_ONLY``, which its offline ``LLM.generate`` uses), its deltas then the whole output."""

MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-2, 2], as in the OpenAI API."""
MAX_LOGIT_BIAS = 100.0
"""logit_bias values lie in [-100, 100], as in the OpenAI API."""


class SamplingParams(BaseModel):
    """How to pick each next token of one request, and when to stop.

    Every bad value raises ``pydantic.ValidationError`` whose message names the
    field and the rule it broke.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, description="Most tokens to generate; at least 1.")
    min_tokens: int = Field(
        0,
        description="EOS and stop_token_ids are ignored until this many tokens were generated; "
        "between 0 and max_tokens.",
    )
    temperature: float = Field(
        1.0,
        description="Divides the logits before sampling; 0 (or below 1e-5) means greedy argmax.",
    )
    top_k: int = Field(0, description="Keep only the k most likely tokens; 0 or -1 turns it off (-1 becomes 0).")
    top_p: float = Field(
        1.0,
        description="Nucleus sampling: keep the fewest most likely tokens whose probability sums "
        "to at least top_p; 0 < top_p <= 1, 1 turns it off.",
    )
    seed: int | None = Field(
        None,
        description="Makes sampling reproducible: the token at each output position depends only "
        "on (seed, position, logits), whatever else is in the batch.",
    )
    stop: list[str] = Field(
        default_factory=list,
        description="Strings that end generation when they appear in the output; a single string "
        "is accepted. The stop string is cut from the output unless include_stop_str_in_output.",
    )
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end generation (each >= 0).")
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")
    include_stop_str_in_output: bool = Field(
        False, description="Keep the matched stop string at the end of the output text."
    )
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the detokenized text.")
    detokenize: bool = Field(
        True,
        description="Turn the tokens into text. False: token ids only, text and delta_text stay empty (vLLM's "
        "detokenize=False); stop strings then cannot be found and are refused.",
    )
    output_kind: OutputKind = Field(
        "stream", description="'stream': an output at every step that adds tokens; 'final_only': one at the end."
    )
    n: int = Field(
        1,
        description="Sequences to generate from the prompt (at most scheduler.max_num_seqs). The prompt is "
        "computed once and its KV blocks are shared; with a seed, sample i draws from (seed, i).",
    )
    logprobs: int | None = Field(
        None,
        description="Return, for each generated token, its logprob and those of the k most likely tokens, "
        "with ranks (0: the chosen token's only). At most model.max_logprobs.",
    )
    prompt_logprobs: int | None = Field(
        None,
        description="Likewise for each prompt token (the first has none: nothing precedes it).",
    )
    logprobs_mode: LogprobsMode = Field(
        "raw",
        description='"raw": log-softmax of the model\'s logits in float32; "processed": of the logits the '
        "token was drawn from (after bias, masks, penalties, temperature, min_p, top_k, top_p).",
    )
    repetition_penalty: float = Field(
        1.0,
        description="HF / CTRL semantics over prompt and output tokens: a seen token's logit is divided by it "
        "when positive, multiplied when negative. > 0; 1 turns it off.",
    )
    presence_penalty: float = Field(
        0.0, description="OpenAI semantics: subtracted once from the logit of every token the output holds; in [-2, 2]."
    )
    frequency_penalty: float = Field(
        0.0,
        description="OpenAI semantics: subtracted from a token's logit once per time the output holds it; in [-2, 2].",
    )
    min_p: float = Field(
        0.0,
        description="Drop tokens whose probability (after temperature) is below min_p times the most likely "
        "token's; in [0, 1], 0 turns it off.",
    )
    logit_bias: dict[int, float] | None = Field(
        None, description="Token id -> bias added to its logit before anything else; each bias in [-100, 100]."
    )
    allowed_token_ids: list[int] | None = Field(
        None, description="If set, only these token ids can be generated (non-empty)."
    )
    bad_words: list[str] = Field(
        default_factory=list,
        description="Words never generated: the engine tokenizes each (with and without a leading space) and "
        "adds the sequences to bad_words_token_ids.",
    )
    bad_words_token_ids: list[list[int]] = Field(
        default_factory=list,
        description="Token sequences the output never completes: the last token of each is banned wherever "
        "the output ends with the others.",
    )

    @field_validator("max_tokens")
    @classmethod
    def _check_max_tokens(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_tokens must be >= 1, got {v}")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _check_min_tokens(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"min_tokens must be >= 0, got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, v: float) -> float:
        if not (math.isfinite(v) and v >= 0):  # written this way so NaN fails too
            raise ValueError(f"temperature must be >= 0 and finite, got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v == -1:
            return 0
        if v < 0:
            raise ValueError(f"top_k must be >= 1, or 0 / -1 to turn it off, got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, v: float) -> float:
        if not (0.0 < v <= 1.0):
            raise ValueError(f"top_p must be > 0 and <= 1, got {v}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop must not contain empty strings (one would match anywhere)")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v: list[int]) -> list[int]:
        bad = [t for t in v if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must each be >= 0, got {bad}")
        return v

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"n must be >= 1, got {v}")
        return v

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _check_logprobs(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(
                f"must be >= 0 (the number of most likely tokens to return besides the chosen one), got {v}"
            )
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _check_repetition_penalty(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"repetition_penalty must be > 0 and finite (1 turns it off), got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_openai_penalty(cls, v: float) -> float:
        if not (math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
            raise ValueError(f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}")
        return v

    @field_validator("min_p")
    @classmethod
    def _check_min_p(cls, v: float) -> float:
        if not (0.0 <= v <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return None
        for token, bias in v.items():
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(
                    f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}"
                )
        return v or None

    @field_validator("allowed_token_ids")
    @classmethod
    def _check_allowed(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("allowed_token_ids must not be empty (no token could be generated); omit it instead")
        bad = [t for t in v if t < 0]
        if bad:
            raise ValueError(f"allowed_token_ids must each be >= 0, got {bad}")
        return v

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, v: list[str]) -> list[str]:
        if any(not w.strip() for w in v):
            raise ValueError("bad_words must not contain empty or blank strings")
        return v

    @field_validator("bad_words_token_ids")
    @classmethod
    def _check_bad_words_ids(cls, v: list[list[int]]) -> list[list[int]]:
        for i, seq in enumerate(v):
            if not seq:
                raise ValueError(f"bad_words_token_ids[{i}] is empty; each entry is a non-empty token sequence")
            if any(t < 0 for t in seq):
                raise ValueError(f"bad_words_token_ids[{i}] holds a negative token id: {seq}")
        return v

    @model_validator(mode="after")
    def _check_min_le_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > max_tokens={self.max_tokens}"
            )
        return self

    @model_validator(mode="after")
    def _check_stop_needs_text(self) -> SamplingParams:
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop strings {self.stop} are found in the detokenized text: they need detokenize=True "
                "(or end on token ids with stop_token_ids)"
            )
        return self

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax token each step (temperature below 1e-5)."""
        return self.temperature < GREEDY_EPSILON

    @property
    def uses_history(self) -> bool:
        """Whether sampling reads the tokens before it (penalties, bad words): the worker then gets them."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.bad_words_token_ids)
        )

    def token_ids_used(self) -> list[int]:
        """The token ids the logit controls name (checked against the vocabulary at submit)."""
        ids = list(self.logit_bias or {})
        ids += self.allowed_token_ids or []
        ids += [t for seq in self.bad_words_token_ids for t in seq]
        return ids


def plain_greedy(p: SamplingParams) -> bool:
    """Whether a row takes the argmax of its raw logits: greedy, and no logit control (allowed tokens, logit bias,
    penalties or bad words) changes them."""
    return p.is_greedy and p.allowed_token_ids is None and not p.logit_bias and not p.uses_history


class RawArgmaxParams:
    """Which ``SamplingParams`` take the argmax of their raw logits and ask for nothing more: ``plain_greedy`` and no
    logprobs (``min_tokens``, which depends on the row, is the caller's to check).

    A request keeps one frozen ``SamplingParams`` for its life, so the answer is kept by object: judged anew it costs
    ~1 us, and a step asks it for every row. Entries hold their object, so an id is never read for another; the
    whole store is dropped when it reaches ``limit`` entries."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._judged: dict[int, tuple[SamplingParams, bool]] = {}

    def __call__(self, params: SamplingParams) -> bool:
        entry = self._judged.get(id(params))
        if entry is None or entry[0] is not params:
            if len(self._judged) >= self.limit:
                self._judged.clear()
            entry = self._judged[id(params)] = (params, plain_greedy(params) and params.logprobs is None)
        return entry[1]
