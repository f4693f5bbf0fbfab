"""The plain, picklable data that crosses the executor bridge.

The scheduler writes a :class:`SchedulerOutput` each step; the worker answers with a
:class:`ModelRunnerOutput`. Both must work unchanged for a thread, a process or a Ray actor,
so they hold only built-in types (and the pydantic ``SamplingParams``), never tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # messages sits at the bottom of the import graph: no runtime imports of ours
    from aioengine.sampling.params import SamplingParams


PLACEHOLDER_TOKEN_ID = -1
"""In ``ScheduledRequest.token_ids``: the token the step before this one samples for the request,
which is not known when this step is scheduled (async scheduling); the worker fills it in."""


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    req_id: str
    token_ids: list[int]
    """Tokens to compute this step: a prefill chunk, or the token sampled last step (which may be
    ``PLACEHOLDER_TOKEN_ID``: the previous step, still running when this one was scheduled, samples it)."""
    start_pos: int
    """Position of ``token_ids[0]``; equals the number of tokens already in the KV cache."""
    block_ids: list[int]
    """The request's whole block table (covers ``start_pos + len(token_ids)`` tokens)."""
    sampling: SamplingParams | None
    """Set when this step reaches the end of the known tokens, so a new token is sampled."""
    output_index: int = 0
    """Tokens generated before this step; keys seeded sampling so it survives preemption."""

    @property
    def sample(self) -> bool:
        return self.sampling is not None


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the worker needs for one step; the worker decides nothing itself."""

    step_id: int
    requests: list[ScheduledRequest]
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests that ended since the last step, so workers can drop any state kept for them."""

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(slots=True)
class ModelRunnerOutput:
    """The tokens sampled in one step, one per request that sampled."""

    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[int]
    forward_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The scheduler's decision on the KV cache, sent to every worker by ``initialize_from_config``."""

    num_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
