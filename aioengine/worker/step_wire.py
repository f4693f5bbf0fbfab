"""Model steps on a process's wire: each step sends what changed since the step before, not every full
block table.

A ``SchedulerOutput`` carries each request's whole block table, and, when sampling reads earlier
tokens, its whole token history: a step of a long generation would weigh as much as its context.
:class:`StepEncoder` (engine side) turns a step into a :class:`StepMessage` against what it sent the
step before; :class:`StepDecoder` (worker process side) rebuilds the identical ``SchedulerOutput``.
Per request the message holds:

- block table and history as a :data:`Change`: the items appended since last time (``(0, tail)``);
  when the new list does not extend the old one (copy-on-write gave the request another last block),
  how many items to drop from the end of the old one, then what follows the part both share;
- ``start_pos`` and ``output_index`` as their change since last time (and the message's ``step_id``
  as its change since the last message), so no number on the wire grows with the context either;
- ``SamplingParams`` as :data:`KEPT` when it is the object sent last time for that request (the
  scheduler hands the same object every step); ``None`` means no sampling, as in the step.

Both sides remember only the requests of the last step: a request absent from a step is forgotten,
and sent whole when it comes back. The two sides must stay in step, so the encoder's new state takes
effect only at :meth:`StepEncoder.commit`, once the message is in every pipe (a message that fails to
pickle changes nothing), and the decoder decodes every message in order, also one whose step then
fails. Each message carries its number (mod 256); the decoder refuses a gap, so a lost message fails
every later step loudly instead of computing on stale block tables.

The encoded form is tuples, lists and ints (``NamedTuple``: about half the bytes of a dataclass, which
pickles its field names in every instance), plus the ``SamplingParams`` and ``PromptLogprobsSpec`` of
the step as they are.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, NamedTuple

from aioengine.messages import PromptLogprobsSpec, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from aioengine.sampling.params import SamplingParams

Change = tuple[int, list[int]]
"""``(drop, tail)``: the list sent last time, less its last ``drop`` items, then ``tail``."""

_LINKS = 256
"""Message numbers count modulo this (one pickled byte): a gap of fewer messages is always seen."""


class Kept(enum.Enum):
    """The type of :data:`KEPT` (an enum member: it pickles by name and stays one object)."""

    KEPT = "kept"


KEPT: Final = Kept.KEPT
"""In place of a ``SamplingParams``: the very object sent for this request last time."""


class RequestStep(NamedTuple):
    """One request's share of a step on the wire (a ``ScheduledRequest`` against the last one sent)."""

    req_id: str
    token_ids: list[int]
    start_pos: int
    """Change since last time (from 0 for a request new to the wire)."""
    blocks: Change
    sampling: SamplingParams | Kept | None
    output_index: int
    """Change since last time (from 0 for a request new to the wire)."""
    sample_index: int
    history: Change | None
    num_prompt_tokens: int
    prompt_logprobs: PromptLogprobsSpec | None
    num_steps: int


class StepMessage(NamedTuple):
    """One step on the wire: a ``SchedulerOutput`` less what the worker process holds from the step before."""

    link: int
    """The message's number, mod 256 (the first is 1)."""
    step_id: int
    """Change since the last message (from 0 for the first)."""
    requests: list[RequestStep]
    blocks_to_swap_in: dict[int, int]
    blocks_to_swap_out: dict[int, int]
    blocks_to_copy: dict[int, list[int]]
    num_steps: int


@dataclass(slots=True)
class _Sent:
    """What both sides hold of one request after a step: what was sent for it, as it was sent."""

    block_ids: list[int]
    history: list[int] = field(default_factory=list)
    """The last history sent (kept over steps that send none, e.g. prefill chunks that do not sample)."""
    sampling: SamplingParams | None = None
    """The last ``SamplingParams`` sent (kept over steps that do not sample)."""
    start_pos: int = 0
    output_index: int = 0


@dataclass(slots=True)
class _State:
    """One side's view after a message: its number, its step id, and the requests it held."""

    number: int = 0
    step_id: int = 0
    requests: dict[str, _Sent] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EncodedStep:
    """A message ready to send, and the encoder's state once it is sent (engine side only)."""

    message: StepMessage
    after: _State


def _change(last: list[int], now: list[int]) -> Change:
    cut = len(last)
    if now[:cut] == last:  # the common case, compared at C speed: an extension
        return 0, now[cut:]
    keep = next((i for i, (a, b) in enumerate(zip(last, now, strict=False)) if a != b), min(cut, len(now)))
    return cut - keep, now[keep:]


def _apply(last: list[int], change: Change) -> list[int]:
    drop, tail = change
    if not 0 <= drop <= len(last):
        raise ValueError(f"a step message drops {drop} items of a list of {len(last)}")
    return last[: len(last) - drop] + tail


class StepEncoder:
    """Engine side: turns each ``SchedulerOutput`` into a :class:`StepMessage` against the last one sent."""

    def __init__(self) -> None:
        self._state = _State()

    def encode(self, output: SchedulerOutput) -> EncodedStep:
        """The message for ``output``; the encoder changes only when it is committed."""
        state = self._state
        requests: list[RequestStep] = []
        after: dict[str, _Sent] = {}
        for r in output.requests:
            last = state.requests.get(r.req_id) or _Sent([])  # new to the wire: from nothing
            history: Change | None = None
            if r.history is not None:
                history = _change(last.history, r.history)
            sampling: SamplingParams | Kept | None = r.sampling
            if r.sampling is not None and r.sampling is last.sampling:
                sampling = KEPT
            requests.append(
                RequestStep(
                    r.req_id,
                    r.token_ids,
                    r.start_pos - last.start_pos,
                    _change(last.block_ids, r.block_ids),
                    sampling,
                    r.output_index - last.output_index,
                    r.sample_index,
                    history,
                    r.num_prompt_tokens,
                    r.prompt_logprobs,
                    r.num_steps,
                )
            )
            after[r.req_id] = _Sent(
                block_ids=list(r.block_ids),  # copies: a step edited after it was sent must not move us
                history=last.history if r.history is None else list(r.history),
                sampling=last.sampling if r.sampling is None else r.sampling,
                start_pos=r.start_pos,
                output_index=r.output_index,
            )
        number = state.number + 1
        message = StepMessage(
            number % _LINKS,
            output.step_id - state.step_id,
            requests,
            output.blocks_to_swap_in,
            output.blocks_to_swap_out,
            output.blocks_to_copy,
            output.num_steps,
        )
        return EncodedStep(message, _State(number, output.step_id, after))

    def commit(self, encoded: EncodedStep) -> None:
        """``encoded`` is in every pipe: the next message builds on it."""
        if encoded.after.number != self._state.number + 1:
            raise RuntimeError("a step message was committed out of order: encode, send, then commit each one")
        self._state = encoded.after


class StepDecoder:
    """Worker process side: rebuilds each ``SchedulerOutput`` from its :class:`StepMessage`, in order."""

    def __init__(self) -> None:
        self._state = _State()

    def decode(self, message: StepMessage) -> SchedulerOutput:
        """The step ``message`` stands for; ``RuntimeError`` when a message before it was not decoded."""
        state = self._state
        number = state.number + 1
        if message.link != number % _LINKS:
            raise RuntimeError(
                f"step message {message.link} (mod {_LINKS}) came where {number % _LINKS} was due: one before it "
                "was lost or could not be decoded, so this worker process's block tables are out of step with the "
                "engine's; create a new engine"
            )
        requests: list[ScheduledRequest] = []
        after: dict[str, _Sent] = {}
        for r in message.requests:
            last = state.requests.get(r.req_id) or _Sent([])  # new to the wire: from nothing
            sent = _Sent(
                block_ids=_apply(last.block_ids, r.blocks),
                history=last.history if r.history is None else _apply(last.history, r.history),
                sampling=last.sampling if r.sampling is KEPT or r.sampling is None else r.sampling,
                start_pos=last.start_pos + r.start_pos,
                output_index=last.output_index + r.output_index,
            )
            if r.sampling is KEPT and sent.sampling is None:
                raise ValueError(f"a step message keeps the sampling params of {r.req_id!r}, which it never sent")
            requests.append(
                ScheduledRequest(
                    req_id=r.req_id,
                    token_ids=r.token_ids,
                    start_pos=sent.start_pos,
                    block_ids=list(sent.block_ids),  # copies: the step is the worker's, our state is ours
                    sampling=None if r.sampling is None else sent.sampling,
                    output_index=sent.output_index,
                    sample_index=r.sample_index,
                    history=None if r.history is None else list(sent.history),
                    num_prompt_tokens=r.num_prompt_tokens,
                    prompt_logprobs=r.prompt_logprobs,
                    num_steps=r.num_steps,
                )
            )
            after[r.req_id] = sent
        step_id = state.step_id + message.step_id
        self._state = _State(number, step_id, after)
        return SchedulerOutput(
            step_id=step_id,
            requests=requests,
            blocks_to_swap_in=message.blocks_to_swap_in,
            blocks_to_swap_out=message.blocks_to_swap_out,
            blocks_to_copy=message.blocks_to_copy,
            num_steps=message.num_steps,
        )
