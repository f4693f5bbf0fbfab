"""Per-request sampling parameters: the pydantic edge where user input is checked."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

GREEDY_EPSILON = 1e-5
"""Temperatures below this are treated as greedy: dividing logits by them overflows."""


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

    @model_validator(mode="after")
    def _check_min_le_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > max_tokens={self.max_tokens}"
            )
        return self

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax token each step (temperature below 1e-5)."""
        return self.temperature < GREEDY_EPSILON
