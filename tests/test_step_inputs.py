"""A step's Python ints as tensors (``aioengine.worker.step_inputs``): the same values and dtype as ``torch.tensor``
makes of them, block tables padded with the null block."""

from __future__ import annotations

import torch

from aioengine.messages import ScheduledRequest
from aioengine.sampling.params import SamplingParams
from aioengine.worker.step_inputs import block_tables, int64_tensor, padded_decode_inputs

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


def test_padded_decode_inputs_hold_each_request_s_token_position_and_blocks() -> None:
    reqs = [ScheduledRequest(f"r{i}", [100 + i], 30 + i, list(range(3 + i % 2)), GREEDY) for i in range(9)]
    ids, positions, tables, groups = padded_decode_inputs(reqs, torch.device("cpu"), decode_kernel=lambda: None)
    assert torch.equal(ids, torch.arange(100, 109)) and torch.equal(positions, torch.arange(30, 39))
    assert tables.shape == (9, 4) and torch.equal(tables[0], torch.tensor([0, 1, 2, 0])) and groups is None
