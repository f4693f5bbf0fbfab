"""A request as the scheduler tracks it."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from aioengine.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self is not _WAITING and self is not _RUNNING  # by identity: read for every request every step


_WAITING, _RUNNING = RequestStatus.WAITING, RequestStatus.RUNNING


@dataclass(slots=True, eq=False)
class Request:
    """Prompt, outputs and KV bookkeeping of one generation."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    """Prompt followed by every generated token: the sequence whose KV the cache holds."""
    num_computed_tokens: int = 0
    """Tokens whose KV is computed or being computed: advanced when a step is scheduled."""
    num_placeholders: int = 0
    """Tokens that scheduled steps will sample but whose outputs have not come back yet (0 or 1)."""
    block_ids: list[int] = field(default_factory=list)
    """The request's KV blocks in order. Replaced, never changed in place: a step scheduled earlier holds the list it
    was sent with."""
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    group_id: str = ""
    """The id of the request the caller submitted (``req_id`` unless it asked for several samples)."""
    sample_index: int = 0
    """Which of the group's sequences this is (the n samples, or the continuations being scored)."""
    num_shared_tokens: int = 0
    """The group's common prefix, which the first sequence computes once for all: the prompt but its
    last token (every sequence computes that one itself, for its own logits)."""
    followers: list[Request] = field(default_factory=list)
    """The group's other sequences, parked here until this one's first ``num_shared_tokens`` tokens are
    scheduled; then they share those blocks and run on their own."""
    leader: Request | None = None
    """Set while this sequence is parked in ``leader.followers``."""
    swapped_blocks: list[int] = field(default_factory=list)
    """Host pool blocks holding this request's KV while it is swapped out (preemption_mode "swap")."""
    cache_salt: str | None = None
    """Part of the first block's prefix-cache key: requests with different salts never share cached KV."""
    block_keys: list[Hashable] = field(default_factory=list)
    """Prefix-cache keys of the leading full blocks, computed once as tokens come (``KVBlockManager``)."""
    num_registered_blocks: int = 0
    """Leading blocks already offered to the prefix cache."""
    cache_epoch: int = -1
    """The prefix cache's epoch when this request's KV began (its blocks register only in that epoch)."""
    prompt_logprobs_from: int | None = None
    """Known tokens from this position on (up to the prompt's end) get logprobs; None: none do."""
    prompt_logprobs_k: int = 0
    prompt_logprobs: dict[int, tuple[list[int], list[float], list[int]]] = field(default_factory=dict)
    """Logprobs of the known tokens so far by position: (token ids, logprobs, ranks), the token's own first."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.group_id:
            self.group_id = self.req_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None
