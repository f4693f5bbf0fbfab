"""The plain, picklable data that crosses the executor bridge, and the names both sides share.

The scheduler writes a :class:`SchedulerOutput` each step; the worker answers with a
:class:`ModelRunnerOutput`. Control calls answer with small frozen reports (:class:`ModelInfo`,
:class:`WorkerSleepReport`, ...). All of it must work unchanged for a thread, a process or a Ray
actor, so it holds only built-in types (and the pydantic ``SamplingParams``), never tensors.
Reports of several ranks merge by an explicit rule per field (``merge``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, get_args

if TYPE_CHECKING:  # messages sits at the bottom of the import graph: no runtime imports of ours
    from aioengine.sampling.params import SamplingParams


PLACEHOLDER_TOKEN_ID = -1
"""In ``ScheduledRequest.token_ids``: the token the step before this one samples for the request,
which is not known when this step is scheduled (async scheduling); the worker fills it in."""

NULL_BLOCK_ID = 0
"""Never handed to a request: padded rows of a decode batch (CUDA-graph buckets) write their KV here."""

SleepLevel = Literal[1, 2]
"""1: weights backed up to host memory; 2: weights discarded (loaded again before serving)."""
WakeTag = Literal["weights", "kv_cache"]
"""What a staged wake restores."""
WAKE_TAGS: tuple[WakeTag, ...] = get_args(WakeTag)

_T = TypeVar("_T")


def check_choice(what: str, value: _T, choices: Any) -> _T:
    """``value`` if it is one of a ``Literal`` type's values, else a ValueError naming ``what`` and the choices.

    The one check of every mode, level and tag a caller passes (their Literal types are the lists).
    """
    allowed = get_args(choices)
    if value not in allowed or isinstance(value, bool):
        raise ValueError(f"{what} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def check_tags(tags: Iterable[str] | None) -> tuple[WakeTag, ...]:
    """The wake tags asked for (None: all of them), each checked; order kept, repeats dropped."""
    if tags is None:
        return WAKE_TAGS
    if isinstance(tags, str):
        raise ValueError(f"wake_up tags must be a list such as ['weights'], got the string {tags!r}")
    return tuple(dict.fromkeys(cast(WakeTag, check_choice("wake_up tag", t, WakeTag)) for t in tags))


# ---- one step --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class PromptLogprobsSpec:
    """Known tokens of a step whose logprobs the worker returns (prompt logprobs, scoring): the logits
    at the position before each give them."""

    k: int
    """Top logprobs besides each token's own."""
    first_pos: int
    """Position of ``token_ids[0]``; ``first_pos - 1`` is a position the step computes."""
    token_ids: list[int]
    """Consecutive tokens from ``first_pos``; the logits of each one's predecessor are in the step."""


@dataclass(slots=True)
class LogprobRows:
    """Logprobs of consecutive positions: per row the chosen token first (sampled, or the known prompt
    token), then the top ``k`` tokens; with the rank of each (1: the most likely)."""

    first_pos: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[list[int]]


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
    sample_index: int = 0
    """Which of the request's ``n`` samples this sequence is; keys seeded sampling with ``output_index``."""
    history: list[int] | None = None
    """Set when sampling reads earlier tokens (penalties, bad words): the sequence's tokens before
    ``start_pos``; with ``token_ids`` they are everything before the sampled token."""
    num_prompt_tokens: int = 0
    """How many tokens of the sequence are prompt (the rest output); sent with ``history``."""
    prompt_logprobs: PromptLogprobsSpec | None = None
    num_steps: int = 1
    """Decode steps the row runs in this step's window (``SchedulerOutput.num_steps``): from its one token at
    ``start_pos``, each step after the first computes the token the one before sampled, at the next position
    (``block_ids`` cover them all). More than 1 only for a row that samples its raw argmax and asks for nothing
    else."""

    @property
    def sample(self) -> bool:
        return self.sampling is not None

    def with_token_ids(self, token_ids: list[int]) -> ScheduledRequest:
        """This request with ``token_ids`` in place of its own, every other field the same object: what the worker
        runs once the previous step's token fills a placeholder. Positional, at a fifth of ``dataclasses.replace``'s
        cost (0.3 us against 1.7 a request, 64 of them a decode step); a field added above must be added here (a
        test compares the two)."""
        return ScheduledRequest(
            self.req_id,
            token_ids,
            self.start_pos,
            self.block_ids,
            self.sampling,
            self.output_index,
            self.sample_index,
            self.history,
            self.num_prompt_tokens,
            self.prompt_logprobs,
            self.num_steps,
        )


@dataclass(slots=True)
class SchedulerOutput:
    """Everything the worker needs for one step; the worker decides nothing itself.

    The block maps are the seeds' cache operations, run by the worker before the forward. Copy-on-write
    is live (``blocks_to_copy``); the swap maps stay empty until swap preemption exists.
    """

    step_id: int
    requests: list[ScheduledRequest]
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    """Copy-on-write: source block -> blocks that get its contents before the forward (a sample of ``n``
    writing into the prompt's shared last block)."""
    num_steps: int = 1
    """A decode window: the most ``ScheduledRequest.num_steps`` of its rows. The worker runs the window's steps
    back to back and answers them in one ``ModelRunnerOutput`` (``worker.step_window``); 1 for every other step."""

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(slots=True)
class ModelRunnerOutput:
    """The tokens sampled in one step, one per request that sampled; in a decode window one per request and step of
    the window, each request's tokens together and in order."""

    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[int]
    forward_seconds: float = 0.0
    logprobs: dict[str, LogprobRows] | None = None
    """Per request that asked (``SamplingParams.logprobs``): one row, the sampled token's."""
    prompt_logprobs: dict[str, LogprobRows] | None = None
    """Per request with a ``PromptLogprobsSpec`` this step: one row per token of the spec."""
    weights_version: int = 0
    """The worker's weights version the step computed with (the worker counts every weight write)."""


# ---- start-up --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The engine's decision on the KV cache, sent to every worker by ``initialize_from_config``."""

    num_cache_blocks: int
    """Blocks allocated per layer, the null block (``NULL_BLOCK_ID``) included."""
    block_size: int
    num_host_blocks: int = 0
    """Blocks of the host pool that swap preemption moves KV to (0: no swapping)."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine needs to know of the loaded model to size the cache and check requests."""

    model_path: str
    """The checkpoint directory the weights came from (``reload_weights`` reads it again)."""
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_model_len: int
    dtype: str
    eos_token_ids: tuple[int, ...]


# ---- control reports -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TagBytes:
    """Bytes per wake tag (weights, KV cache)."""

    weights: int = 0
    kv_cache: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache

    def __add__(self, other: TagBytes) -> TagBytes:
        return TagBytes(self.weights + other.weights, self.kv_cache + other.kv_cache)


def _merged_notes(notes: Iterable[Sequence[str]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(note for group in notes for note in group))


@dataclass(frozen=True, slots=True)
class WorkerSleepReport:
    """One rank's sleep: what it freed."""

    freed_bytes: TagBytes
    seconds: float
    notes: tuple[str, ...] = ()

    @staticmethod
    def merge(reports: Sequence[WorkerSleepReport]) -> WorkerSleepReport:
        """Bytes add up (each rank frees its own shard); seconds of the slowest rank; notes once each."""
        return WorkerSleepReport(
            freed_bytes=sum((r.freed_bytes for r in reports), TagBytes()),
            seconds=max((r.seconds for r in reports), default=0.0),
            notes=_merged_notes(r.notes for r in reports),
        )


@dataclass(frozen=True, slots=True)
class WorkerWakeReport:
    """One rank's wake: what it restored, and what is still asleep there."""

    restored_bytes: TagBytes
    seconds: float
    graph_capture_seconds: float = 0.0
    asleep: tuple[WakeTag, ...] = ()
    notes: tuple[str, ...] = ()

    @staticmethod
    def merge(reports: Sequence[WorkerWakeReport]) -> WorkerWakeReport:
        """Bytes add up; seconds of the slowest rank; a tag is asleep if it is asleep on any rank."""
        return WorkerWakeReport(
            restored_bytes=sum((r.restored_bytes for r in reports), TagBytes()),
            seconds=max((r.seconds for r in reports), default=0.0),
            graph_capture_seconds=max((r.graph_capture_seconds for r in reports), default=0.0),
            asleep=tuple(t for t in WAKE_TAGS if any(t in r.asleep for r in reports)),
            notes=_merged_notes(r.notes for r in reports),
        )


@dataclass(frozen=True, slots=True)
class WorkerWeightsReport:
    """One rank's weight write (or staging): tensors and bytes it took, and the state it left.

    Whoever calls a worker method that writes weights (``update_weights``, or an extension's through
    ``collective_rpc``) gets this back, and the engine learns from it that the weights changed.
    """

    tensors: int
    bytes: int
    seconds: float
    weights_version: int
    """The worker's count of weight writes, this one included (unchanged by staging)."""
    weights_valid: bool
    """False while the weights are still discarded (a partial write after a level-2 sleep)."""

    @staticmethod
    def merge(reports: Sequence[WorkerWeightsReport]) -> WorkerWeightsReport:
        """Every rank reads the same checkpoint tensors (each keeps its slice): tensors are rank 0's;
        bytes add up (each rank writes its own shard); seconds of the slowest rank; the newest
        version; valid only if valid on every rank."""
        return WorkerWeightsReport(
            tensors=reports[0].tensors if reports else 0,
            bytes=sum(r.bytes for r in reports),
            seconds=max((r.seconds for r in reports), default=0.0),
            weights_version=max((r.weights_version for r in reports), default=0),
            weights_valid=all(r.weights_valid for r in reports),  # serving needs every rank's weights
        )
