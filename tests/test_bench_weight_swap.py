"""The weight_swap benchmark's trainer process and table, without an engine and without timing anything."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.weight_push import Trainer, hf_tensors, join_group
from benchmarks.weight_swap import Swap, table
from plugins.weight_sync import leave_group, weight_metadata


def test_the_trainer_process_broadcasts_the_checkpoint_in_metadata_order(llama_ckpt: Path) -> None:
    expected = hf_tensors(llama_ckpt)
    buffers = [torch.empty(shape, dtype=getattr(torch, dtype)) for _, dtype, shape in weight_metadata(expected)]
    with Trainer([llama_ckpt]) as trainer:
        store, group = join_group(trainer.port)
        trainer.push(llama_ckpt)
        for buf in buffers:
            group.broadcast(buf, 0).wait()
        trainer.end()
        leave_group(group)
        trainer.join()
        del store
    assert all(torch.equal(buf, t) for buf, t in zip(buffers, expected.values(), strict=True))


def test_the_table_shows_each_rows_median_swap_and_dashes_where_a_report_has_no_figure() -> None:
    rpc = [Swap(75, 10**9, seconds, seconds - 0.1, None, seconds + 0.1) for seconds in (3.0, 1.0, 2.0)]
    rows = [("an rpc", rpc, "a floor"), ("a push", rpc, "another"), ("staged", rpc, None)]
    lines = table(10**9, {"a floor": 0.5, "another": 4.0}, rows)
    assert lines[2] == "| a floor | - | 0.500 | 2.00 | - | - | - | - |"
    assert lines[4] == "| an rpc | 75 | 2.000 (1.000-3.000) | 0.50 | 4.00x | 1.900 | - | 2.100 |"
    assert lines[5] == "| a push | 75 | 2.000 (1.000-3.000) | 0.50 | 0.50x | 1.900 | - | 2.100 |"
    assert lines[6] == "| staged | 75 | 2.000 (1.000-3.000) | 0.50 | - | 1.900 | - | 2.100 |"
