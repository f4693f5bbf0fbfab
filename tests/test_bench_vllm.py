"""The throughput benchmark's vLLM side and FLOP ceiling, without vLLM installed and without timing anything."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from benchmarks import report, vllm_cpu
from benchmarks.ceiling import Ceiling, GemmPeak, ModelShape, workload_flops
from benchmarks.engine_run import EngineRun
from benchmarks.results import SystemResult
from benchmarks.workload import MODELS, BenchRequest

TINY = ModelShape(
    hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=32000
)
PRELOADS = vllm_cpu.Preloads(tcmalloc="/lib/libtcmalloc_minimal.so.4", iomp="/venv/lib/libiomp5.so")


def test_model_shape_comes_from_config_json(tmp_path: Path) -> None:
    spec = MODELS["tiny"]
    config = {
        "hidden_size": spec["hidden_size"],
        "intermediate_size": spec["intermediate_size"],
        "num_hidden_layers": spec["num_layers"],
        "num_attention_heads": spec["num_heads"],
        "num_key_value_heads": spec["num_kv_heads"],
        "vocab_size": spec["vocab_size"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelShape.from_config(tmp_path) == TINY  # head_dim: hidden / heads when the config has none


def test_flops_of_one_request_match_the_hand_count() -> None:
    # Prompt of 3, 2 output tokens: 4 tokens processed (3 prompt + the first output as a decode input).
    # One layer's projections: q, o 256*256 each; k, v 256*128 each; gate, up, down 256*688 each.
    layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688
    assert TINY.layer_weights == layer == 724_992
    flops = workload_flops(TINY, [BenchRequest([5, 6, 7], 2)])
    assert flops.processed_tokens == 4
    assert flops.linear == 2 * 724_992 * 4 * 4 == 23_199_744  # 2 FLOPs per weight, 4 layers, 4 tokens
    assert flops.lm_head == 2 * 256 * 32000 * 2 == 32_768_000  # one logits row per output token
    # Causal: the tokens at positions 0..3 attend to 1..4 keys, 10 pairs; 4 * heads * head_dim per pair, per layer.
    assert flops.attention == 4 * 4 * 64 * 4 * 10 == 40_960
    assert flops.total == 23_199_744 + 32_768_000 + 40_960


def test_ceiling_is_output_tokens_over_flops_at_peak() -> None:
    flops = workload_flops(TINY, [BenchRequest([5, 6, 7], 2)])
    peak = GemmPeak(flops_per_s=1e9, shape=(1, 1, 1), per_shape={}, threads=2)
    ceiling = Ceiling(peak, flops)
    assert ceiling.tokens_per_s == pytest.approx(2 * 1e9 / (23_199_744 + 32_768_000 + 40_960))
    assert ceiling.tokens_per_s_without_attention == pytest.approx(2 * 1e9 / (23_199_744 + 32_768_000))
    assert ceiling.share(ceiling.tokens_per_s / 4) == pytest.approx(0.25)
    assert ceiling.share(None) is None


def test_out_of_the_box_sets_only_the_kv_cache_space() -> None:
    assert vllm_cpu.setting_env("out of the box", {0, 1}, PRELOADS, 2) == {"VLLM_CPU_KVCACHE_SPACE": "2"}


def test_documented_binds_every_core_and_preloads_tcmalloc_then_iomp() -> None:
    assert vllm_cpu.setting_env("documented", {0, 1}, PRELOADS, 4) == {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "LD_PRELOAD": "/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so",
    }


def test_best_is_documented_with_the_engine_in_process() -> None:
    best = vllm_cpu.setting_env("best", {0, 1}, PRELOADS, 4)
    assert best == vllm_cpu.setting_env("documented", {0, 1}, PRELOADS, 4) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_missing_preloads_leave_ld_preload_unset() -> None:
    env = vllm_cpu.setting_env("documented", {0, 1}, vllm_cpu.Preloads(None, None), 1)
    assert "LD_PRELOAD" not in env
    assert vllm_cpu.Preloads(None, "/x/libiomp5.so").describe() == "tcmalloc not found, libiomp5 found"


def test_unknown_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown vLLM setting"):
        vllm_cpu.setting_env("fastest", {0}, PRELOADS, 1)


def test_cpu_list_is_written_as_ranges() -> None:
    assert vllm_cpu.cpu_list({0, 1}) == "0-1"
    assert vllm_cpu.cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert vllm_cpu.cpu_list({3}) == "3"


def test_kv_cache_space_holds_every_request_in_whole_gib() -> None:
    assert vllm_cpu.kv_cache_gib(TINY, [BenchRequest([1] * 200, 100)] * 64) == 1
    # 30 layers x 2 x 3 KV heads x 64 x 4 bytes = 46,080 bytes a token; 64 x 384 tokens x 1.5 = 1.6 GiB.
    real = ModelShape(576, 1536, 30, 9, 3, 64, 49152)
    assert vllm_cpu.kv_cache_gib(real, [BenchRequest([1] * 256, 128)] * 64) == 2


def test_vllm_python_comes_from_the_flag_then_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_cpu.PYTHON_ENV, raising=False)
    assert vllm_cpu.vllm_python(None) is None
    monkeypatch.setenv(vllm_cpu.PYTHON_ENV, "/env/python")
    assert vllm_cpu.vllm_python(None) == Path("/env/python")
    assert vllm_cpu.vllm_python("/flag/python") == Path("/flag/python")


def test_throughput_skips_vllm_without_a_python(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from benchmarks import throughput

    monkeypatch.delenv(vllm_cpu.PYTHON_ENV, raising=False)
    args = throughput.parse_args(["--out", str(tmp_path)])
    assert args.vllm_settings == list(vllm_cpu.SETTINGS)
    assert throughput.start_vllm(Path("unused"), [], args) == []


def test_throughput_reads_vllm_settings_with_hyphens_or_spaces() -> None:
    from benchmarks import throughput

    assert throughput._settings("best,out-of-the-box,out of the box") == ["best", "out of the box", "out of the box"]


def test_throughput_refuses_an_unknown_vllm_setting() -> None:
    from benchmarks import throughput

    with pytest.raises(argparse.ArgumentTypeError, match="choose from"):
        throughput._settings("documented,turbo")


def test_a_python_without_vllm_is_reported_not_started(tmp_path: Path) -> None:
    assert vllm_cpu.check_python(tmp_path / "no-python") is not None
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": "x", "prompts": [[1]], "max_tokens": [1]}))
    run = vllm_cpu.VllmRun("best", Path(sys.executable), spec, {}, tmp_path / "vllm.log", PRELOADS)
    assert not run.start()  # the driver dies importing vllm
    assert run.run() is None
    row = run.result()
    assert row.name == "vLLM CPU, best"
    assert row.tokens_per_s is None
    assert row.note.startswith("not available: did not start")


def test_pair_ratios_take_each_repeat_in_turn() -> None:
    runs = [{"tokens_per_s": 100.0}, {"tokens_per_s": 50.0}]
    assert vllm_cpu.pair_ratios([200.0, 150.0, 90.0], runs) == [2.0, 3.0]


def test_systems_table_gives_each_system_its_share_of_the_ceiling() -> None:
    flops = workload_flops(TINY, [BenchRequest([5, 6, 7], 2)])
    ceiling = Ceiling(GemmPeak(1e9, (1, 1, 1), {}, 2), flops)
    ours = SystemResult("aioengine", ceiling.tokens_per_s / 2, 1.0, startup_seconds=0.5)
    run = EngineRun(ours, 1.0, 1.0, 1, None, None, [])
    vllm = SystemResult("vLLM CPU, best", ceiling.tokens_per_s / 4, 2.0, startup_seconds=30.0)
    lines = report.systems_table(run, [vllm], ceiling)
    assert "share of ceiling" in lines[0]
    assert lines[2].startswith("| aioengine |") and "| 0.50 | 0.5 |" in lines[2]
    assert lines[3].startswith("| vLLM CPU, best |") and "| 2.00x | 0.25 | 30.0 |" in lines[3]
    assert lines[4].startswith("| **FLOP ceiling** |")
