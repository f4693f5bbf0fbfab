"""Prefix caching on vs off, side by side on one checkpoint, on three workloads.

    python -m benchmarks prefix_cache [--model tiny|small|real] [--repeat 1] [--requests 64]
                                      [--system-len 1024] [--conversations 8] [--turns 6]
                                      [--only shared,chat,zero_hits]

- shared prefix: ``--requests`` requests, each one system prompt (``--system-len`` random token ids,
  seed 0) + its own ``--question-len``-token question, all submitted at once.
- multi-turn chat: ``--conversations`` conversations of ``--turns`` turns, run concurrently; each turn
  resubmits the whole history (the previous turns' prompts and the tokens the engine generated) plus a
  new ``--message-len``-token user message. Turns of one conversation run one after another.
- zero hits: throughput's workload (workload.py: random prompts, nothing shared), all at once; caching
  must cost nothing when it finds nothing.

Every request asks for ``--max-tokens`` tokens (the zero-hit workload keeps workload.py's lengths),
greedy, min_tokens = max_tokens and EOS ignored, so both engines do the same work. float32. Two engines,
caching on and off, one after the other, a fresh one for every run; ``--repeat N`` alternates them N
times (which goes first alternates too) and reports each by its median run. Every run starts from a
cold prefix cache (emptied after the engine's warm-up request). The KV cache holds the largest workload
whole without caching: no preemption (the table shows the count). TTFT runs from a request's submission
to its first output; the hit rate is ``engine.stats()``'s over the run (prompt tokens whose KV was
reused / prompt tokens looked up).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import torch

from aioengine import AsyncEngine, EngineConfig, EngineStats, SamplingParams
from benchmarks.cpu_load import CpuLoad
from benchmarks.engine_run import engine_config
from benchmarks.loop_lag import percentile
from benchmarks.report import table
from benchmarks.results import SystemResult
from benchmarks.throughput import log, median, with_spread
from benchmarks.workload import DEFAULT_CACHE, MODELS, BenchRequest, checkpoint, output_tokens, vocab_size, workload

SHARED, CHAT, ZERO_HIT = "shared prefix", "multi-turn chat", "zero hits"
NOISY = 0.3
"""Cores busy elsewhere (cpu_load.py) above which a run is flagged, as throughput's report does."""
OPTION = {SHARED: "shared", CHAT: "chat", ZERO_HIT: "zero_hits"}
"""Each workload's name in ``--only``."""
ON, OFF = "caching on", "caching off"

Work = Callable[[AsyncEngine, list[float]], Awaitable[list[list[int]]]]
"""Runs a workload on an engine, appending every request's TTFT; returns the tokens it generated."""


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """What to run, what it is credited (output tokens) and each output's length (a conversation's: its
    whole history), to check that nothing came back short."""

    name: str
    work: Work
    tokens: int
    lengths: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class CacheRun:
    """One workload on one engine: throughput, latency, what the cache found and where the time went."""

    result: SystemResult
    ttft_p50: float | None
    ttft_p90: float | None
    hit_rate: float
    num_steps: int
    worker_seconds: float
    preemptions: int
    outputs: tuple[tuple[int, ...], ...]
    """Every request's generated tokens (a conversation's whole history), to compare on against off."""


def shared_prefix(
    num_requests: int, system_len: int, question_len: int, max_tokens: int, vocab: int
) -> list[BenchRequest]:
    """One system prompt + a unique question per request (seed 0; ids from 3 up, like workload.py)."""
    rng = np.random.default_rng(0)
    system = rng.integers(3, vocab, system_len).tolist()
    questions = [rng.integers(3, vocab, question_len).tolist() for _ in range(num_requests)]
    return [BenchRequest(system + question, max_tokens) for question in questions]


def chat_messages(conversations: int, turns: int, message_len: int, vocab: int) -> list[list[list[int]]]:
    """Each conversation's user messages, one per turn (seed 2)."""
    rng = np.random.default_rng(2)
    return [[rng.integers(3, vocab, message_len).tolist() for _ in range(turns)] for _ in range(conversations)]


def greedy(max_tokens: int) -> SamplingParams:
    """Exactly ``max_tokens`` greedy tokens."""
    return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0, ignore_eos=True)


async def generate(engine: AsyncEngine, prompt: list[int], max_tokens: int, ttfts: list[float]) -> list[int]:
    """One request to its end; appends its TTFT (submission to first output) and returns its tokens."""
    submitted = time.perf_counter()
    tokens: list[int] = []
    async for out in engine.generate(prompt, greedy(max_tokens)):
        if not tokens:
            ttfts.append(time.perf_counter() - submitted)
        tokens = out.token_ids
    return list(tokens)


def at_once(reqs: list[BenchRequest]) -> Work:
    """Every request submitted at once."""

    async def work(engine: AsyncEngine, ttfts: list[float]) -> list[list[int]]:
        return list(await asyncio.gather(*(generate(engine, r.prompt, r.max_tokens, ttfts) for r in reqs)))

    return work


def chats(messages: list[list[list[int]]], max_tokens: int) -> Work:
    """The conversations concurrently, each turn on the whole history so far."""

    async def conversation(engine: AsyncEngine, turns: list[list[int]], ttfts: list[float]) -> list[int]:
        history: list[int] = []
        for message in turns:
            prompt = history + message
            history = prompt + await generate(engine, prompt, max_tokens, ttfts)
        return history

    async def work(engine: AsyncEngine, ttfts: list[float]) -> list[list[int]]:
        return list(await asyncio.gather(*(conversation(engine, turns, ttfts) for turns in messages)))

    return work


async def measure(engine: AsyncEngine, name: str, load: Workload) -> CacheRun:
    """One run of ``load`` from a cold prefix cache."""
    await engine.reset_prefix_cache()
    before = engine.stats()
    ttfts: list[float] = []
    with CpuLoad() as others:
        start = time.perf_counter()
        outputs = await load.work(engine, ttfts)
        seconds = time.perf_counter() - start
    after = engine.stats()
    short = sum(1 for out, n in zip(outputs, load.lengths, strict=True) if len(out) != n)
    note = f"{short} outputs of a wrong length" if short else ""
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return CacheRun(
        result=SystemResult(name, load.tokens / seconds, seconds, note, others.others),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        hit_rate=hits / queries if queries else 0.0,
        num_steps=after.num_steps - before.num_steps,
        worker_seconds=after.worker_seconds - before.worker_seconds,
        preemptions=after.num_preemptions - before.num_preemptions,
        outputs=tuple(tuple(out) for out in outputs),
    )


def _median_run(runs: list[CacheRun]) -> CacheRun:
    chosen = median(runs, lambda r: r.result.seconds or 0.0)
    return dataclasses.replace(chosen, result=with_spread(chosen.result, [r.result for r in runs]))


def configs(path: Path, largest: list[BenchRequest], args: argparse.Namespace) -> dict[str, EngineConfig]:
    """The two engines' configs: the same but for ``enable_prefix_caching``; a KV cache that holds
    ``largest`` whole without caching."""
    base = engine_config(path, largest, args.max_num_seqs, args.max_batched_tokens)
    return {
        name: base.model_copy(update={"cache": base.cache.model_copy(update={"enable_prefix_caching": on})})
        for name, on in ((ON, True), (OFF, False))
    }


async def run_once(config: EngineConfig, name: str, load: Workload, longest: int) -> tuple[CacheRun, EngineStats]:
    """A fresh engine for one run of ``load``: started, warmed up, measured, shut down. Its stats come along
    for the KV cache's shape."""
    async with AsyncEngine(config) as engine:
        stats = engine.stats()
        if stats.max_model_len is not None and longest > stats.max_model_len:
            raise SystemExit(f"the longest request is {longest} tokens, over max_model_len={stats.max_model_len}")
        await generate(engine, [3] * 40, 4, [])  # warm-up, untimed; measure() drops its blocks from the cache
        return await measure(engine, name, load), stats


async def run_all(
    path: Path, loads: list[Workload], largest: list[BenchRequest], longest: int, args: argparse.Namespace
) -> tuple[dict[str, dict[str, CacheRun]], dict[str, list[float]], str]:
    """Every workload on both engines, alternated ``args.repeat`` times: the median runs, the on / off
    tokens/s of each repeat (adjacent runs, so they share the machine's load) and the KV cache's shape.

    Every run gets an engine of its own: two long-lived engines differ by more than caching does (two of
    one config, alternated on a quiet machine, ran 5-15% apart, the same one slower every time)."""
    runs: dict[str, dict[str, list[CacheRun]]] = {load.name: {ON: [], OFF: []} for load in loads}
    config = configs(path, largest, args)
    shape = ""
    for i in range(args.repeat):
        order = (ON, OFF) if i % 2 == 0 else (OFF, ON)
        for load in loads:
            for system in order:
                r, stats = await run_once(config[system], system, load, longest)
                runs[load.name][system].append(r)
                log(
                    f"{load.name}, {system}: {r.result.tokens_per_s:.1f} tok/s, TTFT p50 {_ms(r.ttft_p50)} ms, "
                    f"hit rate {r.hit_rate:.1%}, {r.num_steps} steps, {r.preemptions} preemptions"
                )
                shape = (
                    f"{stats.kv_blocks_total} KV blocks of {stats.block_size} tokens, max_model_len "
                    f"{stats.max_model_len}, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
                    f"{args.max_batched_tokens}"
                )
    medians = {name: {s: _median_run(by[s]) for s in (ON, OFF)} for name, by in runs.items()}
    paired = {
        name: [_over(a.result.tokens_per_s, b.result.tokens_per_s) or 0.0 for a, b in zip(by[ON], by[OFF], strict=True)]
        for name, by in runs.items()
    }
    return medians, paired, shape


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _met(value: float | None, target: float) -> str:
    return "-" if value is None else ("yes" if value >= target else "**no**")


def _target(targeted: bool, value: float | None, target: float) -> list[str]:
    """The target and whether it was met, for a ratio the issue sets one for."""
    return [f">= {target:g}x", _met(value, target)] if targeted else ["-", "-"]


def markdown(title: str, medians: dict[str, dict[str, CacheRun]], paired: dict[str, list[float]]) -> str:
    """The runs table, then the ratios beside the issue's targets: for the shared prefix >= 3x tokens/s and
    >= 5x lower TTFT p50 with caching on; with zero hits, on within 2% of off."""
    head = [
        "workload",
        "caching",
        "output tokens/s",
        "seconds",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "hit rate",
        "steps",
        "worker s",
        "preemptions",
        "other load (cores)",
        "note",
    ]
    rows = [
        [
            name,
            run.result.name.removeprefix("caching "),
            f"{run.result.tokens_per_s:.1f}",
            f"{run.result.seconds:.2f}",
            _ms(run.ttft_p50),
            _ms(run.ttft_p90),
            f"{run.hit_rate:.1%}",
            str(run.num_steps),
            f"{run.worker_seconds:.2f}",
            str(run.preemptions),
            "-" if run.result.others_load is None else f"{run.result.others_load:.2f}",
            run.result.note,
        ]
        for name, by in medians.items()
        for run in (by[ON], by[OFF])
    ]
    lines = [title, "", *table(head, rows, left=(0, 1, 11)), ""]

    checks: list[list[str]] = []
    for name, by in medians.items():
        on, off = by[ON], by[OFF]
        speedup = _over(on.result.tokens_per_s, off.result.tokens_per_s)
        if name == ZERO_HIT:
            checks.append([f"{name}: tokens/s on / off", _fmt(speedup, "{:.3f}"), ">= 0.98", _met(speedup, 0.98)])
        else:
            ttft = _over(off.ttft_p50, on.ttft_p50)
            targeted = name == SHARED  # the issue sets targets for the shared prefix only
            checks += [
                [f"{name}: tokens/s on / off", _fmt(speedup, "{:.2f}x"), *_target(targeted, speedup, 3.0)],
                [f"{name}: TTFT p50 off / on", _fmt(ttft, "{:.2f}x"), *_target(targeted, ttft, 5.0)],
            ]
        same = sum(1 for a, b in zip(on.outputs, off.outputs, strict=True) if a == b)
        pairs = ", ".join(f"{p:.3f}" for p in paired[name])
        if len(paired[name]) > 1:
            pairs += f" (median {float(np.median(paired[name])):.3f})"
        checks.append([f"{name}: tokens/s on / off of each repeat (adjacent runs)", pairs, "-", "-"])
        checks.append([f"{name}: greedy outputs equal on and off", f"{same} of {len(on.outputs)}", "-", "-"])
    lines += table(["check", "measured", "target", "met"], checks)
    busy = [
        f"{r.result.name} {name} ({r.result.others_load:.2f})"
        for name, by in medians.items()
        for r in by.values()
        if r.result.others_load is not None and r.result.others_load > NOISY
    ]
    if busy:
        lines += [
            "",
            f"**Noisy**: other processes kept cores busy during {', '.join(busy)}; a ratio can be off by tens of "
            "percent (compare the repeats). Rerun on a quiet machine.",
        ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks prefix_cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where built checkpoints are kept")
    parser.add_argument("--requests", type=int, default=64, help="shared-prefix requests")
    parser.add_argument("--system-len", type=int, default=1024, help="shared system prompt, tokens")
    parser.add_argument("--question-len", type=int, default=32, help="each shared-prefix request's own tokens")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per shared-prefix request and chat turn")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--message-len", type=int, default=32, help="each chat turn's new user tokens")
    parser.add_argument("--zero-hit-requests", type=int, default=64, help="a prefix of throughput's fixed 64")
    parser.add_argument(
        "--only",
        type=lambda text: [x for x in text.split(",") if x],
        default=list(OPTION.values()),
        help=f"comma separated, of {', '.join(OPTION.values())} (default: all)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="alternate the engines N times; report each's median")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    args = parser.parse_args(argv)
    if unknown := set(args.only) - set(OPTION.values()):
        parser.error(f"--only: unknown {', '.join(sorted(unknown))}; choose from {', '.join(OPTION.values())}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    path = checkpoint(args.model, args.cache)
    vocab = vocab_size(args.model)
    shared = shared_prefix(args.requests, args.system_len, args.question_len, args.max_tokens, vocab)
    messages = chat_messages(args.conversations, args.turns, args.message_len, vocab)
    history_len = args.turns * (args.message_len + args.max_tokens)
    zero_hit = workload(args.zero_hit_requests, vocab)
    everything = [
        Workload(SHARED, at_once(shared), output_tokens(shared), [r.max_tokens for r in shared]),
        Workload(
            CHAT,
            chats(messages, args.max_tokens),
            len(messages) * args.turns * args.max_tokens,
            [history_len] * len(messages),
        ),
        Workload(ZERO_HIT, at_once(zero_hit), output_tokens(zero_hit), [r.max_tokens for r in zero_hit]),
    ]
    loads = [load for load in everything if OPTION[load.name] in args.only]
    # The KV cache is sized for the workload that holds the most tokens at once without caching.
    last_turns = [BenchRequest([0] * (history_len - args.max_tokens), args.max_tokens)] * args.conversations
    largest = max((shared, last_turns, zero_hit), key=lambda reqs: sum(len(r.prompt) + r.max_tokens for r in reqs))
    longest = max(len(r.prompt) + r.max_tokens for r in [*shared, *last_turns, *zero_hit])
    log(
        f"model {args.model} at {path}; {SHARED}: {len(shared)} x ({args.system_len} + {args.question_len}) tokens; "
        f"{CHAT}: {args.conversations} x {args.turns} turns; {ZERO_HIT}: {len(zero_hit)} requests"
    )
    medians, paired, shape = asyncio.run(run_all(path, loads, largest, longest, args))
    title = (
        f"Prefix caching on vs off, model {args.model}, float32 CPU, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; {shape}. {SHARED}: {len(shared)} requests of one {args.system_len}-token "
        f"system prompt + a {args.question_len}-token question, {args.max_tokens} new tokens each, all at once. "
        f"{CHAT}: {args.conversations} conversations x {args.turns} turns of {args.message_len} new user tokens "
        f"+ {args.max_tokens} generated, concurrent. {ZERO_HIT}: throughput's {len(zero_hit)} requests "
        f"({output_tokens(zero_hit)} output tokens). "
        + (f"Median of {args.repeat} alternated runs." if args.repeat > 1 else "One run each.")
    )
    print(markdown(title, medians, paired))
    print(f"\n({time.perf_counter() - started:.0f}s in all)")


if __name__ == "__main__":
    main()
