"""Turns a throughput run into a markdown table (stdout), a JSON file and a PNG plot.

The plot needs matplotlib, a bench-only extra (``pip install -e .[bench]``); without it the plot is
skipped with a message and everything else is written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from benchmarks.ceiling import Ceiling
from benchmarks.engine_run import LAG_TICK, EngineRun
from benchmarks.results import Floors, OnlineResult, SystemResult


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _load(cores: float | None) -> str:
    return "-" if cores is None else f"{cores:.2f}"


def ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def best_static(systems: list[SystemResult]) -> SystemResult | None:
    """The fastest HF static batch size, renamed as the "best static" row; None if none ran."""
    static = [s for s in systems if s.name.startswith("HF generate") and s.tokens_per_s]
    if not static:
        return None
    best = max(static, key=lambda s: s.tokens_per_s or 0.0)
    return dataclasses.replace(best, name=f"HF generate, best static ({best.name.rsplit(' ', 1)[-1]})")


def table(head: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """Markdown lines; the columns in ``left`` left-aligned, the others (numbers) right."""
    align = ["---" if i in left else "---:" for i in range(len(head))]
    return [f"| {' | '.join(cells)} |" for cells in [head, align, *rows]]


def _share(ceiling: Ceiling, tokens_per_s: float | None) -> str:
    share = ceiling.share(tokens_per_s)
    return "-" if share is None else f"{share:.2f}"


def systems_table(run: EngineRun, systems: list[SystemResult], ceiling: Ceiling | None = None) -> list[str]:
    """Offline tokens/s of every system, aioengine's ratio to each, start-up where measured, and, with a
    ceiling, each system's share of it."""
    ours = run.result.tokens_per_s
    rows = [run.result, *systems]
    if (best := best_static(systems)) is not None:
        rows.append(best)
    head = ["system", "output tokens/s", "seconds", "aioengine / system", "start-up s", "other load (cores)", "note"]
    if ceiling is not None:
        head.insert(4, "share of ceiling")
    lines = []
    for s in rows:
        cells = [
            s.name,
            "not available" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}",
            "-" if s.seconds is None else f"{s.seconds:.2f}",
            ratio(ours, s.tokens_per_s),
            "-" if s.startup_seconds is None else f"{s.startup_seconds:.1f}",
            _load(s.others_load),
            s.note,
        ]
        if ceiling is not None:
            cells.insert(4, _share(ceiling, s.tokens_per_s))
        lines.append(cells)
    if ceiling is not None:
        ceiling_row = ["**FLOP ceiling**", f"{ceiling.tokens_per_s:.1f}", "-", ratio(ours, ceiling.tokens_per_s)]
        lines.append([*ceiling_row, "1.00", "-", _load(ceiling.peak.others_load), "fp32 GEMM peak; see below"])
    return table(head, lines, left=(0, len(head) - 1))


def pairs_lines(pairs: dict[str, list[float]]) -> list[str]:
    """aioengine / vLLM per repeat, for each setting: how steady the ratio was."""
    return [
        f"aioengine / {name}, each repeat: {', '.join(f'{r:.2f}' for r in ratios)}"
        for name, ratios in pairs.items()
        if ratios
    ]


def speed_lines(speeds: dict[str, list[float]]) -> list[str]:
    """The host's speed before each system's every repeat (``host_speed.HostSpeed``), in GFLOP/s."""
    listed = [f"{name} {', '.join(f'{g:.0f}' for g in rates)}" for name, rates in speeds.items() if rates]
    if not listed:
        return []
    return [f"Host speed before each repeat (GFLOP/s of one GEMM in a helper process): {'; '.join(listed)}"]


def efficiencies(repeats: list[EngineRun]) -> list[float]:
    """Each replayed repeat's engine efficiency: its steps replayed right after it, over its wall time."""
    return [sum(r.replay) / r.wall for r in repeats if r.replay]


def replay_shares(repeats: list[EngineRun], ceiling: Ceiling | None) -> list[float]:
    """Each replayed repeat's share of the ceiling at its replay's speed: the worker alone, without the engine
    around it (its share over its efficiency)."""
    if ceiling is None:
        return []
    return [
        share * r.wall / sum(r.replay)
        for r in repeats
        if r.replay and (share := ceiling.share(r.result.tokens_per_s)) is not None
    ]


def replay_lines(repeats: list[EngineRun], ceiling: Ceiling | None) -> list[str]:
    """The two per-repeat figures of the repeats' own replays."""
    lines = []
    if listed := ", ".join(f"{e:.2f}" for e in efficiencies(repeats)):
        lines.append(
            f"Engine efficiency each repeat (its steps replayed on the worker right after it, over its wall): {listed}"
        )
    if listed := ", ".join(f"{e:.2f}" for e in replay_shares(repeats, ceiling)):
        lines.append(f"The worker alone, each repeat (its replay's share of the ceiling): {listed}")
    return lines


def time_table(run: EngineRun, floors: Floors | None) -> list[str]:
    """Where the offline wall time went; the replay floor's share is the engine efficiency."""
    wall = run.wall

    def row(what: str, seconds: float) -> list[str]:
        return [what, f"{seconds:.2f}", f"{seconds / wall:.2f}"]

    rows = [row(f"wall ({run.num_steps} steps)", wall), row("worker busy (stats worker_seconds)", run.worker_seconds)]
    if floors is None:
        rows.append(["replay and GEMM floors", "-", "not measured: no steps recorded"])
    else:
        decode_steps = floors.num_steps - floors.num_prefill_steps
        replayed = (
            f"**replay floor** (the same {floors.num_steps} steps, {floors.num_forwards} forwards, on the worker, "
            "right after)"
        )
        efficiency = row(replayed, floors.replay_seconds)
        efficiency[2] = f"**{efficiency[2]}** = engine efficiency"
        rows += [
            efficiency,
            row(f"... {floors.num_prefill_steps} steps with prompt tokens", floors.replay_prefill_seconds),
            row(f"... {decode_steps} decode-only steps", floors.replay_seconds - floors.replay_prefill_seconds),
            row("GEMM-only floor (every Linear, same steps)", floors.gemm_seconds),
            ["(other load during the floors, cores)", _load(floors.others_load), "-"],
        ]
    tick = f"{LAG_TICK * 1e3:.0f} ms ticker"
    rows.append([f"event loop lag p99 at full load ({tick})", f"{_ms(run.loop_lag_p99)} ms", "-"])
    rows.append(["event loop lag p99, engine idle (timer noise)", f"{_ms(run.idle_loop_lag_p99)} ms", "-"])
    return table(["aioengine offline: where the time went", "seconds", "share of wall"], rows)


def online_table(online: list[OnlineResult]) -> list[str]:
    """Latency percentiles and loop lag per arrival rate."""
    head = [
        "online: Poisson rate req/s (of offline)",
        "requests",
        "output tokens/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "loop lag p99 ms",
        "other load",
    ]
    return table(
        head,
        [
            [
                f"{o.rate:.2f} ({o.fraction:.0%})",
                str(o.num_requests),
                f"{o.tokens_per_s:.1f}",
                _ms(o.ttft_p50),
                _ms(o.ttft_p99),
                _ms(o.itl_p50),
                _ms(o.itl_p99),
                _ms(o.loop_lag_p99),
                _load(o.others_load),
            ]
            for o in online
        ],
    )


def noisy(
    run: EngineRun,
    systems: list[SystemResult],
    floors: Floors | None,
    online: list[OnlineResult],
    threshold: float = 0.3,
    ceiling: Ceiling | None = None,
) -> list[str]:
    """Names of the measurements taken while other processes kept more than ``threshold`` cores busy."""
    loads = [(s.name, s.others_load) for s in [run.result, *systems]]
    loads += [("the GEMM peak", ceiling.peak.others_load if ceiling else None)]
    loads += [("floors", floors.others_load if floors else None)]
    loads += [(f"online {o.fraction:.0%}", o.others_load) for o in online]
    return [f"{name} ({load:.2f})" for name, load in loads if load is not None and load > threshold]


def markdown(
    title: str,
    run: EngineRun,
    systems: list[SystemResult],
    floors: Floors | None,
    online: list[OnlineResult],
    ceiling: Ceiling | None = None,
    pairs: dict[str, list[float]] | None = None,
    speeds: dict[str, list[float]] | None = None,
    repeats: list[EngineRun] | None = None,
) -> str:
    """The whole report: ``title``, then the three tables (the ceiling's line below the first)."""
    lines = [title, "", *systems_table(run, systems, ceiling)]
    if ceiling is not None:
        lines += ["", ceiling.describe()]
    if pair_lines := pairs_lines(pairs or {}):
        lines += ["", *pair_lines]
    if host_lines := speed_lines(speeds or {}):
        lines += ["", *host_lines]
    lines += ["", *time_table(run, floors)]
    if replayed := replay_lines(repeats or [], ceiling):
        lines += ["", *replayed]
    if online:
        lines += ["", *online_table(online)]
    if busy := noisy(run, systems, floors, online, ceiling=ceiling):
        lines += [
            "",
            f"**Noisy**: other processes kept cores busy during {', '.join(busy)}; torch's "
            "threads then wait on each other and a number can be several times too slow. Rerun.",
        ]
    return "\n".join(lines)


def write_json(
    path: Path,
    meta: dict[str, Any],
    run: EngineRun,
    systems: list[SystemResult],
    floors: Floors | None,
    online: list[OnlineResult],
    ceiling: Ceiling | None = None,
    pairs: dict[str, list[float]] | None = None,
    speeds: dict[str, list[float]] | None = None,
    repeats: list[EngineRun] | None = None,
) -> None:
    """Everything measured plus ``meta`` (model, versions, limits) as one JSON object."""
    ours = run.result.tokens_per_s
    best = best_static(systems)

    def shares(s: SystemResult) -> dict[str, float | None]:
        return {"ceiling_share": ceiling.share(s.tokens_per_s)} if ceiling is not None else {}

    data = {
        **meta,
        "aioengine": {
            **dataclasses.asdict(run.result),
            **shares(run.result),
            "wall_seconds": run.wall,
            "worker_seconds": run.worker_seconds,
            "num_steps": run.num_steps,
            "loop_lag_p99_seconds": run.loop_lag_p99,
            "idle_loop_lag_p99_seconds": run.idle_loop_lag_p99,
        },
        "systems": [
            {
                **dataclasses.asdict(s),
                **shares(s),
                "aioengine_ratio": ours / s.tokens_per_s if ours and s.tokens_per_s else None,
            }
            for s in systems
        ],
        "aioengine_vllm_ratio_each_repeat": pairs or {},
        "host_speed_gflops_before_each_repeat": speeds or {},
        "ceiling": None
        if ceiling is None
        else {
            "gemm_peak": dataclasses.asdict(ceiling.peak),
            "flops": {**dataclasses.asdict(ceiling.flops), "total": ceiling.flops.total},
            "tokens_per_s": ceiling.tokens_per_s,
            "tokens_per_s_without_attention": ceiling.tokens_per_s_without_attention,
        },
        "hf_best_static": dataclasses.asdict(best) if best else None,
        "floors": dataclasses.asdict(floors) if floors else None,
        "engine_efficiency": floors.replay_seconds / run.wall if floors else None,
        "engine_efficiency_each_repeat": efficiencies(repeats or []),
        "replay_ceiling_share_each_repeat": replay_shares(repeats or [], ceiling),
        "online": [dataclasses.asdict(o) for o in online],
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_plot(path: Path, title: str, run: EngineRun, systems: list[SystemResult], online: list[OnlineResult]) -> bool:
    """Bars of tokens/s per system beside latency vs arrival rate. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bars = [s for s in [run.result, *systems] if s.tokens_per_s]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=[1.3, 1])
    colors = [
        "tab:green" if s.name == "aioengine" else "tab:blue" if s.name.startswith("vLLM") else "tab:gray" for s in bars
    ]
    left.barh([s.name for s in bars][::-1], [s.tokens_per_s for s in bars][::-1], color=colors[::-1])
    for y, s in enumerate(bars[::-1]):
        left.text(s.tokens_per_s, y, f" {s.tokens_per_s:.0f}", va="center", fontsize=8)  # type: ignore[arg-type]
    left.set_xlabel("output tokens/s (offline, higher is better)")
    left.set_title("throughput")
    if online:
        rates = [o.rate for o in online]
        for key, style in (("ttft_p50", "o-"), ("ttft_p99", "o--"), ("itl_p50", "s-"), ("itl_p99", "s--")):
            values = [getattr(o, key) for o in online]
            right.plot(
                rates, [v * 1e3 if v is not None else float("nan") for v in values], style, label=key.replace("_", " ")
            )
        right.set_yscale("log")
        right.set_xlabel("arrival rate, requests/s (Poisson)")
        right.set_ylabel("ms")
        right.set_title("aioengine latency vs rate")
        right.legend(fontsize=8)
    else:
        right.set_axis_off()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
