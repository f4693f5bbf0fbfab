"""A GRPO-shaped rollout: every prompt sampled n times at temperature 1, all submitted at once.

    python -m benchmarks grpo [--prompts 32] [--n 8] [--min-out 64] [--max-out 256]
                              [--model tiny|small|real] [--skip-hf] [--repeat 1]

Prompts are throughput's (workload.py: random token ids, lengths U[16, 256]). Each prompt's output
length is drawn U[min-out, max-out] (inclusive) and all n samples of that prompt get the same one,
since max_tokens is per request; min_tokens = max_tokens and EOS is ignored, so lengths are exact.
float32, temperature 1.0, top-k and top-p off, seeded. Systems, on one checkpoint in one process:

- aioengine, n = 8: one request per prompt; its samples share the prompt's KV blocks.
- aioengine, separate: n requests of n = 1 per prompt (each its own seed), same lengths.
- HF ``generate(num_return_sequences=n, do_sample=True)``: one prompt after another.

Every system is credited prompts x n x its max_tokens. ``--repeat N`` alternates the systems N times
and reports each by its median run. The peak KV blocks in use (``engine.stats()``, read after every
output) show the prompt stored once per group.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from aioengine import AsyncEngine, SamplingParams
from benchmarks.cpu_load import CpuLoad
from benchmarks.engine_run import engine_config
from benchmarks.hf_baselines import load_hf
from benchmarks.report import ratio, table
from benchmarks.results import SystemResult
from benchmarks.throughput import log, median, with_spread
from benchmarks.workload import DEFAULT_CACHE, MODELS, BenchRequest, checkpoint, vocab_size, workload

GROUPED = "aioengine, n = {n} per request"
SEPARATE = "aioengine, {n} requests of n = 1 per prompt"
HF = "HF generate, num_return_sequences = {n}"


@dataclasses.dataclass(frozen=True, slots=True)
class EngineResult:
    """One engine run: its throughput and the most KV blocks its sequences held at once."""

    result: SystemResult
    peak_blocks: int


@dataclasses.dataclass(frozen=True, slots=True)
class GrpoRun:
    """Every system's median run, and the engine's KV cache they ran in."""

    grouped: EngineResult
    separate: EngineResult
    hf: SystemResult | None
    """None with --skip-hf."""
    block_size: int
    kv_blocks_total: int


def rollout(num_prompts: int, vocab: int, min_out: int, max_out: int) -> list[BenchRequest]:
    """Throughput's prompts, each with its own output length U[min_out, max_out] (seed 1)."""
    rng = np.random.default_rng(1)
    return [
        dataclasses.replace(r, max_tokens=int(rng.integers(min_out, max_out + 1))) for r in workload(num_prompts, vocab)
    ]


def sampling(max_tokens: int, seed: int, n: int = 1) -> SamplingParams:
    """Temperature 1, nothing cut off, exactly ``max_tokens`` tokens per sample."""
    return SamplingParams(
        n=n, max_tokens=max_tokens, min_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True
    )


class PeakBlocks:
    """The most KV blocks in use at any ``look()``, from ``engine.stats()`` (called after every output)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.peak = 0

    def look(self) -> None:
        stats = self.engine.stats()
        self.peak = max(self.peak, stats.kv_blocks_total - stats.kv_blocks_free)


async def _consume(engine: AsyncEngine, prompt: list[int], params: SamplingParams, peak: PeakBlocks) -> list[int]:
    """One request's stream to its end; the token count of each of its samples."""
    last = None
    async for out in engine.generate(prompt, params):
        peak.look()
        last = out
    assert last is not None
    return [len(o.token_ids) for o in last.outputs]


async def run_engine(engine: AsyncEngine, reqs: list[BenchRequest], n: int, grouped: bool, seed: int) -> EngineResult:
    """Every request at once, grouped (n samples each) or as n separate requests per prompt."""
    if grouped:
        calls = [(r.prompt, sampling(r.max_tokens, seed + i, n)) for i, r in enumerate(reqs)]
    else:  # seeds after the grouped ones, one per sample
        first = seed + len(reqs)
        calls = [(r.prompt, sampling(r.max_tokens, first + i * n + j)) for i, r in enumerate(reqs) for j in range(n)]
    expected = [r.max_tokens for r in reqs for _ in range(n)]
    peak = PeakBlocks(engine)
    with CpuLoad() as load:
        start = time.perf_counter()
        counts = await asyncio.gather(*(_consume(engine, prompt, params, peak) for prompt, params in calls))
        seconds = time.perf_counter() - start
    got = [c for per_request in counts for c in per_request]
    short = sum(1 for c, e in zip(got, expected, strict=True) if c != e)
    note = f"{short} sequences got a different token count" if short else f"{len(calls)} requests at once"
    name = (GROUPED if grouped else SEPARATE).format(n=n)
    return EngineResult(SystemResult(name, sum(expected) / seconds, seconds, note, load.others), peak.peak)


@torch.inference_mode()
def _hf_samples(model: Any, req: BenchRequest, n: int) -> int:
    """``n`` samples of one prompt; returns how many rows came back with exactly max_tokens new tokens."""
    ids = torch.tensor([req.prompt])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,  # HF would otherwise default to 50; the engine's top-k is off
        top_p=1.0,
        num_return_sequences=n,
        max_new_tokens=req.max_tokens,
        min_new_tokens=req.max_tokens,  # keeps EOS from ending a row early
        pad_token_id=0,
    )
    return n if tuple(out.shape) == (n, len(req.prompt) + req.max_tokens) else 0


def run_hf(model: Any, reqs: list[BenchRequest], n: int, seed: int) -> SystemResult:
    """HF ``generate`` per prompt, a batch of its ``n`` samples, one prompt after another."""
    torch.manual_seed(seed)
    with CpuLoad() as load:
        start = time.perf_counter()
        exact = sum(_hf_samples(model, r, n) for r in reqs)
        seconds = time.perf_counter() - start
    short = n * len(reqs) - exact
    note = f"{short} sequences got a different token count" if short else f"{len(reqs)} calls of batch {n}"
    return SystemResult(HF.format(n=n), n * sum(r.max_tokens for r in reqs) / seconds, seconds, note, load.others)


def _median_engine(runs: list[EngineResult]) -> EngineResult:
    chosen = median(runs, lambda r: r.result.seconds or 0.0)
    return EngineResult(with_spread(chosen.result, [r.result for r in runs]), max(r.peak_blocks for r in runs))


async def run_all(path: Path, reqs: list[BenchRequest], args: argparse.Namespace) -> GrpoRun:
    """The systems alternated ``args.repeat`` times; one engine and one HF model for all of them.

    HF runs on the loop thread while the engine idles (its loop waits on an event, its worker on a queue).
    """
    n = args.n
    separate = [r for r in reqs for _ in range(n)]  # the KV cache holds the separate run whole: no preemption
    max_seqs = args.max_num_seqs or len(separate)
    config = engine_config(path, separate, max_seqs, args.max_batched_tokens, prefix_caching=True)  # as served
    model = None if args.skip_hf else load_hf(path)
    if model is not None:
        _hf_samples(model, BenchRequest(reqs[0].prompt[:16], 2), 2)  # warm-up, untimed
    grouped_runs: list[EngineResult] = []
    separate_runs: list[EngineResult] = []
    hf_runs: list[SystemResult] = []
    async with AsyncEngine(config) as engine:
        await _consume(engine, reqs[0].prompt[:16], sampling(2, 0, 2), PeakBlocks(engine))  # warm-up, untimed
        stats = engine.stats()
        for _ in range(args.repeat):
            for runs, grouped in ((grouped_runs, True), (separate_runs, False)):
                runs.append(await run_engine(engine, reqs, n, grouped, args.seed))
                done = runs[-1]
                log(f"{done.result.name}: {done.result.tokens_per_s:.1f} tok/s, peak {done.peak_blocks} KV blocks")
            if model is not None:
                hf_runs.append(run_hf(model, reqs, n, args.seed))
                log(f"{hf_runs[-1].name}: {hf_runs[-1].tokens_per_s:.1f} tok/s")
    hf = with_spread(median(hf_runs, lambda r: r.seconds or 0.0), hf_runs) if hf_runs else None
    return GrpoRun(
        _median_engine(grouped_runs), _median_engine(separate_runs), hf, stats.block_size, stats.kv_blocks_total
    )


def markdown(title: str, reqs: list[BenchRequest], n: int, run: GrpoRun) -> str:
    """The table, the ratios and the KV blocks."""
    grouped, separate, hf, block_size = run.grouped, run.separate, run.hf, run.block_size
    peaks = {grouped.result.name: grouped.peak_blocks, separate.result.name: separate.peak_blocks}
    rows = [grouped.result, separate.result, *([hf] if hf else [])]
    head = ["system", "output tokens/s", "seconds", "peak KV blocks", "other load (cores)", "note"]
    lines = table(
        head,
        [
            [
                s.name,
                f"{s.tokens_per_s:.1f}" if s.tokens_per_s else "-",
                f"{s.seconds:.2f}" if s.seconds else "-",
                str(peaks.get(s.name, "-")),
                "-" if s.others_load is None else f"{s.others_load:.2f}",
                s.note,
            ]
            for s in rows
        ],
        left=(0, 5),
    )
    ours = grouped.result.tokens_per_s
    ratios = [f"n = {n} vs separate requests: {ratio(ours, separate.result.tokens_per_s)}"]
    if hf is not None:
        ratios.append(f"n = {n} vs HF generate: {ratio(ours, hf.tokens_per_s)}")
    # A shared block is a full prompt block; the partial last one is copied per sample before it is written.
    shared = sum(len(r.prompt) // block_size for r in reqs)
    kv = (
        f"KV blocks of {block_size} tokens ({run.kv_blocks_total} in the cache): peak in use {grouped.peak_blocks} "
        f"with n = {n} vs {separate.peak_blocks} separate ({separate.peak_blocks - grouped.peak_blocks} fewer). "
        f"The prompts fill {shared} full blocks; stored once per group that saves up to "
        f"{(n - 1) * shared} blocks while every sequence is resident."
    )
    return "\n".join([title, "", *lines, "", *ratios, "", kv])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks grpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=32, help="prompts (a prefix of throughput's fixed 64)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--min-out", type=int, default=64, help="shortest output, tokens (capped at --max-out)")
    parser.add_argument("--max-out", type=int, default=256, help="longest output, tokens")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where built checkpoints are kept")
    parser.add_argument("--skip-hf", action="store_true", help="only the two engine runs")
    parser.add_argument("--repeat", type=int, default=1, help="alternate the systems N times; report each's median")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (per request: seed + its index)")
    parser.add_argument(
        "--max-num-seqs", type=int, default=0, help="engine sequences per step; 0: prompts x n, all at once"
    )
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    args = parser.parse_args(argv)
    if args.min_out < 1:
        parser.error(f"--min-out must be >= 1, got {args.min_out}")
    args.min_out = min(args.min_out, args.max_out)  # so --max-out 32 alone is a quick run
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    path = checkpoint(args.model, args.cache)
    reqs = rollout(args.prompts, vocab_size(args.model), args.min_out, args.max_out)
    tokens = args.n * sum(r.max_tokens for r in reqs)
    log(f"model {args.model} at {path}; {len(reqs)} prompts x n = {args.n}, {tokens} output tokens")
    run = asyncio.run(run_all(path, reqs, args))
    title = (
        f"{len(reqs)} prompts x n = {args.n} ({tokens} output tokens; max_tokens U[{args.min_out}, {args.max_out}] "
        f"per prompt, shared by its {args.n} samples), model {args.model}, float32 CPU, temperature 1.0 seeded, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, transformers {transformers.__version__}"
    )
    print(markdown(title, reqs, args.n, run))
    print(f"\n({time.perf_counter() - started:.0f}s in all)")


if __name__ == "__main__":
    main()
