"""A step's inputs: its scheduled requests, placeholders filled, as the forward's device tensors.

Input preparation is vectorised: one flat token list per step, positions and slot mappings
computed with tensor ops, never per token in Python.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from aioengine.int_tensors import int64_tensor
from aioengine.messages import NULL_BLOCK_ID, PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from aioengine.model.attention import AttentionMetadata, PrefillChunk, split_decode_rows


@dataclass(slots=True)
class StepInputs:
    """Device tensors of one step, plus which request each sampled row belongs to."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    """Rows of the logits the model computes: one per sampling request, then one per known token whose
    logprob a request asked for (``prompt_reqs``, in order)."""
    sample_reqs: list[ScheduledRequest]
    prompt_reqs: list[ScheduledRequest]


def block_tables(reqs: Sequence[ScheduledRequest], width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The requests' block ids as a [len(reqs), width] int64 table, each row padded with the null block (0)."""
    return int64_tensor(_table_ints(reqs, width), device).view(len(reqs), width)


def _table_ints(reqs: Sequence[ScheduledRequest], width: int) -> list[int]:
    """``block_tables``' entries, row after row."""
    flat: list[int] = []
    for r in reqs:
        flat += r.block_ids
        flat += [NULL_BLOCK_ID] * (width - len(r.block_ids))
    return flat


def fill_placeholders(sched: SchedulerOutput, last_sampled: dict[str, int]) -> SchedulerOutput:
    """Puts the tokens the previous step sampled (``last_sampled``, by request) in place of their placeholders
    (async scheduling)."""
    # One pass (every row of every decode step has one): the rows are copied only from the first placeholder on.
    requests = sched.requests
    reqs: list[ScheduledRequest] | None = None
    for i, r in enumerate(requests):
        ids = r.token_ids
        if ids and ids[-1] == PLACEHOLDER_TOKEN_ID:
            token = last_sampled.get(r.req_id)
            if token is None:
                raise RuntimeError(
                    f"request {r.req_id!r} was scheduled with the token of a step that did not "
                    "sample it (placeholder without a previous sample)"
                )
            if reqs is None:
                reqs = requests[:i]
            r = r.with_token_ids([*ids[:-1], token])
        if reqs is not None:
            reqs.append(r)
    return sched if reqs is None else dataclasses.replace(sched, requests=reqs)


def prepare_inputs(
    sched: SchedulerOutput,
    block_size: int,
    device: torch.device,
    *,
    decode_kernel: Callable[..., None] | None = None,
    prefill_kernel: Callable[..., None] | None = None,
) -> StepInputs:
    """The inputs of ``sched``'s forward; the attention kernels, where given, go into its metadata (the C++
    decode attention reads context lengths in place of a mask and row groups)."""
    # Decodes (one query token) first, then prefill chunks: the attention's layout.
    reqs = sorted(sched.requests, key=lambda r: len(r.token_ids) != 1)
    bs = block_size
    lens = int64_tensor([len(r.token_ids) for r in reqs])
    starts = int64_tensor([r.start_pos for r in reqs])
    tables = block_tables(reqs, max(len(r.block_ids) for r in reqs))
    cu = torch.cumsum(lens, 0)
    total = int(cu[-1])
    row = torch.repeat_interleave(torch.arange(len(reqs)), lens)
    positions = starts[row] + torch.arange(total) - (cu - lens)[row]
    slots = tables[row, positions // bs] * bs + positions % bs

    num_decodes = sum(1 for r in reqs if len(r.token_ids) == 1)
    dev = device
    decode_tables = decode_mask = decode_lens = None
    groups = None
    if num_decodes:
        nb = max(len(r.block_ids) for r in reqs[:num_decodes])
        decode_tables = tables[:num_decodes, :nb].to(dev)
        ctx = starts[:num_decodes] + 1
        if decode_kernel is not None:
            decode_lens = ctx.to(dev)
        else:
            decode_mask = (torch.arange(nb * bs).unsqueeze(0) < ctx.unsqueeze(1)).view(num_decodes, 1, 1, nb * bs)
            decode_mask = decode_mask.to(dev)
            groups = split_decode_rows([len(r.block_ids) for r in reqs[:num_decodes]])
    prefills = [
        PrefillChunk(int(cu[i] - lens[i]), int(lens[i]), int(starts[i]), tables[i, : len(reqs[i].block_ids)].to(dev))
        for i in range(num_decodes, len(reqs))
    ]
    sample_rows = [i for i, r in enumerate(reqs) if r.sample]
    meta = AttentionMetadata(
        slots.to(dev),
        num_decodes,
        decode_tables,
        decode_mask,
        prefills,
        decode_groups=_on_device(groups, dev),
        decode_kernel=decode_kernel,
        decode_context_lens=decode_lens,
        prefill_kernel=prefill_kernel,
    )
    input_ids = int64_tensor([t for r in reqs for t in r.token_ids], dev)
    indices = cu[sample_rows] - 1
    prompt_rows = [i for i, r in enumerate(reqs) if r.prompt_logprobs is not None]
    if prompt_rows:
        extra = []
        for i in prompt_rows:
            spec = reqs[i].prompt_logprobs
            assert spec is not None
            first = int(cu[i] - lens[i]) + spec.first_pos - 1 - reqs[i].start_pos
            extra.append(torch.arange(first, first + len(spec.token_ids)))
        indices = torch.cat([indices, *extra])
    return StepInputs(
        input_ids,
        positions.to(dev),
        meta,
        indices.to(dev),
        [reqs[i] for i in sample_rows],
        [reqs[i] for i in prompt_rows],
    )


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """A batch of decodes as ``PaddedDecodeRunner`` takes it (``padded_decode_inputs``)."""

    rows: torch.Tensor
    """[3, B] int64: each row's token id, position and KV slot, one tensor that the runner copies at once."""
    block_tables: torch.Tensor
    """[B, W] int64, each row padded with the null block to the longest."""
    groups: list[tuple[torch.Tensor, int]] | None = None
    """The torch attention's row groups by context length (``split_decode_rows``); None under a decode kernel."""

    @property
    def size(self) -> int:
        return self.rows.shape[1]


def padded_decode_inputs(
    reqs: list[ScheduledRequest],
    device: torch.device,
    decode_kernel: Callable[..., None] | None,
    block_size: int,
) -> DecodeBatch:
    """A batch of decodes, one token each, for ``PaddedDecodeRunner.run``: made from one list of Python ints (a
    step's tensors from its 64 rows otherwise cost a dozen torch ops)."""
    width = max(len(r.block_ids) for r in reqs)
    flat = [r.token_ids[0] for r in reqs]
    flat += [r.start_pos for r in reqs]
    flat += [r.block_ids[r.start_pos // block_size] * block_size + r.start_pos % block_size for r in reqs]
    flat += _table_ints(reqs, width)
    both = int64_tensor(flat, device)
    b = len(reqs)
    groups = None if decode_kernel is not None else split_decode_rows([len(r.block_ids) for r in reqs])
    return DecodeBatch(both[: 3 * b].view(3, b), both[3 * b :].view(b, width), _on_device(groups, device))


def next_decode_batch(batch: DecodeBatch, tokens: torch.Tensor, keep: list[int] | None, block_size: int) -> DecodeBatch:
    """``batch`` one step on, as the next step of a decode window runs it: each row's token the one its step sampled
    (``tokens``), at the next position, its KV slot read from its block table (which covers the whole window);
    ``keep``: the rows that go on (None: all). What ``padded_decode_inputs`` makes of those rows, without reading
    them; no row groups (a decode kernel or a captured graph runs it)."""
    tables, positions = batch.block_tables, batch.rows[1] + 1
    if keep is not None:
        index = int64_tensor(keep, tables.device)
        tables, positions, tokens = tables[index], positions[index], tokens[index]
    blocks = tables.gather(1, torch.div(positions, block_size, rounding_mode="floor").unsqueeze(1)).squeeze(1)
    return DecodeBatch(torch.stack([tokens, positions, blocks * block_size + positions % block_size]), tables)


@dataclass(slots=True)
class WindowBatch:
    """A decode window's last step on the model runner: its rows and their batch, and the tokens it sampled once it
    has (``moved_on`` makes the next step's batch of them)."""

    step_id: int
    reqs: list[ScheduledRequest]
    batch: DecodeBatch
    sampled: torch.Tensor | None = None

    def moved_on(self, reqs: list[ScheduledRequest], block_size: int) -> DecodeBatch:
        """The batch of the window's next step, whose rows ``reqs`` are these rows that go on, in order; they become
        the last step's."""
        assert self.sampled is not None
        keep = None
        if len(reqs) != len(self.reqs):  # rows that ran all their steps leave
            going = {r.req_id for r in reqs}
            keep = [i for i, r in enumerate(self.reqs) if r.req_id in going]
        batch = next_decode_batch(self.batch, self.sampled, keep, block_size)
        self.reqs, self.batch, self.sampled = reqs, batch, None
        return batch


class DecodeWindow:
    """The model runner's decode window in progress: its last step's batch (``WindowBatch``), which the window's next
    step moves on."""

    def __init__(self) -> None:
        self._last: WindowBatch | None = None

    def next_batch(self, sched: SchedulerOutput, block_size: int) -> DecodeBatch | None:
        """The batch of ``sched`` where it is the next step of the window in progress (``worker.step_window`` makes
        it of the step before, under the window's step id) and that step was sampled; else None, and no window is
        kept."""
        last = self._last
        if last is not None and last.step_id == sched.step_id and sched.num_steps == 1 and last.sampled is not None:
            return last.moved_on(sched.requests, block_size)
        self._last = None
        return None

    def start(self, sched: SchedulerOutput, batch: DecodeBatch) -> None:
        """``sched``, a window's first step, runs ``batch``: its next step moves it on."""
        self._last = WindowBatch(sched.step_id, sched.requests, batch)

    def sampled(self, step_id: int, tokens: torch.Tensor) -> None:
        """``tokens`` ([rows] int64, on the batch's device), just sampled by step ``step_id``, are what the window's
        next step computes."""
        last = self._last
        if last is not None and last.step_id == step_id:
            last.sampled = tokens


def _on_device(
    groups: list[tuple[list[int], int]] | None, device: torch.device
) -> list[tuple[torch.Tensor, int]] | None:
    return None if groups is None else [(int64_tensor(rows, device), width) for rows, width in groups]
