"""The benchmarks' host-speed probe (``benchmarks.host_speed``): a GEMM's rate from a helper process, on demand."""

from __future__ import annotations

import pytest

from benchmarks.host_speed import HostSpeed


def test_each_probe_times_the_gemm_in_the_helper_process_and_the_block_ends_it() -> None:
    with HostSpeed() as speed:
        rates = [speed.probe(), speed.probe()]
        process = speed._process
    assert all(0.1 < rate < 1e6 for rate in rates)  # GFLOP/s: more than a trickle, less than a petaflop
    assert process is not None and process.returncode == 0


def test_a_probe_outside_the_block_is_refused() -> None:
    with pytest.raises(RuntimeError, match="outside its with block"):
        HostSpeed().probe()


def test_the_report_lists_each_system_s_speeds_in_order_and_nothing_without_them() -> None:
    from benchmarks.report import speed_lines

    lines = speed_lines({"aioengine": [185.2, 141.0], "vLLM CPU, best": [181.0, 140.6], "HF": []})
    assert lines == [
        "Host speed before each repeat (GFLOP/s of one GEMM in a helper process): aioengine 185, 141; "
        "vLLM CPU, best 181, 141"
    ]
    assert speed_lines({}) == [] and speed_lines({"aioengine": []}) == []
