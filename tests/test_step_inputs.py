"""A step's Python ints as tensors (``aioengine.worker.step_inputs``): the same values and dtype as ``torch.tensor``
makes of them, block tables padded with the null block; placeholders filled with the tokens sampled last."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aioengine.int_tensors import int64_tensor
from aioengine.messages import PLACEHOLDER_TOKEN_ID, PromptLogprobsSpec, ScheduledRequest, SchedulerOutput
from aioengine.sampling.params import SamplingParams
from aioengine.worker.step_inputs import (
    WindowBatch,
    block_tables,
    fill_placeholders,
    next_decode_batch,
    padded_decode_inputs,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def test_int64_tensor_equals_torch_tensor_of_the_same_ints() -> None:
    for values in ([5], [0, -3, 2**40, 7], list(range(513))):
        got = int64_tensor(values)
        assert got.dtype == torch.int64 and torch.equal(got, torch.tensor(values, dtype=torch.int64))
    assert torch.equal(int64_tensor(iter([1, 2, 3])), torch.tensor([1, 2, 3]))
    empty = int64_tensor([])
    assert empty.dtype == torch.int64 and empty.shape == (0,)


def test_block_tables_pad_each_row_with_the_null_block() -> None:
    reqs = [ScheduledRequest(f"r{i}", [5], 16 * i, list(range(10 * i, 10 * i + i + 1)), GREEDY) for i in range(5)]
    table = block_tables(reqs, 7)
    want = torch.tensor([r.block_ids + [0] * (7 - len(r.block_ids)) for r in reqs])
    assert table.shape == (5, 7) and table.dtype == torch.int64 and torch.equal(table, want)


def test_padded_decode_inputs_hold_each_request_s_token_position_slot_and_blocks() -> None:
    reqs = [ScheduledRequest(f"r{i}", [100 + i], 30 + i, [5, 6 + i, 20 + i, 40][: 3 + i % 2], GREEDY) for i in range(9)]
    batch = padded_decode_inputs(reqs, torch.device("cpu"), decode_kernel=lambda: None, block_size=16)
    ids, positions, slots = batch.rows
    assert batch.size == 9 and torch.equal(ids, torch.arange(100, 109)) and torch.equal(positions, torch.arange(30, 39))
    # Position 30 + i lies in the request's second block (16..31) up to i = 1, its third (32..47) after.
    want = [(6 + i) * 16 + 30 + i - 16 if 30 + i < 32 else (20 + i) * 16 + 30 + i - 32 for i in range(9)]
    assert slots.tolist() == want
    assert batch.block_tables.shape == (9, 4) and batch.groups is None
    assert batch.block_tables[0].tolist() == [5, 6, 20, 0] and batch.block_tables[1].tolist() == [5, 7, 21, 40]


@pytest.mark.parametrize("keep", [None, [0, 2, 3, 6]], ids=["every row goes on", "some rows leave"])
def test_a_windows_next_batch_is_what_its_rows_moved_on_make(keep: list[int] | None) -> None:
    """A decode window's next step moves the batch on with tensor ops: the same rows as ``padded_decode_inputs``
    makes of the requests one position on, their tokens the ones sampled, across block boundaries."""
    kernel = lambda: None  # noqa: E731 - a decode kernel present: no row groups
    reqs = [ScheduledRequest(f"r{i}", [100 + i], 28 + i, [5, 6 + i, 20 + i, 40 + i], GREEDY) for i in range(8)]
    batch = padded_decode_inputs(reqs, torch.device("cpu"), kernel, block_size=16)
    sampled = torch.arange(500, 508)
    moved = [reqs[i] for i in (keep if keep is not None else range(8))]
    want = padded_decode_inputs(
        [dataclasses.replace(r, token_ids=[500 + reqs.index(r)], start_pos=r.start_pos + 1) for r in moved],
        torch.device("cpu"),
        kernel,
        block_size=16,
    )
    got = next_decode_batch(batch, sampled, keep, block_size=16)
    assert torch.equal(got.rows, want.rows) and torch.equal(got.block_tables, want.block_tables)
    assert got.groups is None
    # WindowBatch finds the rows that go on by the next step's requests, which become its own.
    window = WindowBatch(7, reqs, batch, sampled)
    again = window.moved_on(moved, block_size=16)
    assert torch.equal(again.rows, want.rows) and window.reqs is moved and window.sampled is None


def test_with_token_ids_keeps_every_other_field() -> None:
    # Every field set off its default, so a field the method forgets shows as a difference.
    r = ScheduledRequest("r", [1, 2], 9, [4, 5], GREEDY, 3, 1, [7, 8], 2, PromptLogprobsSpec(1, 10, [2]), 4)
    assert {f.name for f in dataclasses.fields(r)} - {"token_ids"} == {
        f.name for f in dataclasses.fields(r) if getattr(r, f.name) != f.default and f.name != "token_ids"
    }
    assert r.with_token_ids([6]) == dataclasses.replace(r, token_ids=[6])


def test_fill_placeholders_puts_the_last_sampled_tokens_in_new_requests() -> None:
    known = ScheduledRequest("a", [11, 12], 0, [1], GREEDY)
    waiting = ScheduledRequest("b", [PLACEHOLDER_TOKEN_ID], 5, [2], GREEDY, output_index=3)
    sched = SchedulerOutput(4, [known, waiting])
    filled = fill_placeholders(sched, {"b": 42, "a": 99})
    assert [r.token_ids for r in filled.requests] == [[11, 12], [42]]
    assert filled.requests[0] is known and filled.requests[1].output_index == 3 and filled.step_id == 4
    assert waiting.token_ids == [PLACEHOLDER_TOKEN_ID]  # the scheduler's message is left as it was sent
    assert fill_placeholders(SchedulerOutput(5, [known]), {}).requests == [known]
    with pytest.raises(RuntimeError, match="placeholder without a previous sample"):
        fill_placeholders(sched, {"a": 1})
