"""``aioengine demo``: what the engine is for, on the default model in well under a minute.

Several chat prompts streamed at once, sleep level 1 and wake, sleep level 2 and reload, a hot
weight swap to other weights of the same shape and back while a request streams, and a closing
table of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import textwrap
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aioengine.cli import _has_chat_template, _mb, _messages, _Model
from aioengine.config import EngineConfig
from aioengine.engine.async_engine import AsyncEngine
from aioengine.sampling.params import SamplingParams

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "Give me three tips for sleeping well.",
    "Name the planets of the solar system.",
]
SWAP_PROMPT = "Tell me a short story about a fox."
SWAP_NOISE = 0.1
"""The demo's other weights: the checkpoint with Gaussian noise of 10% of each matrix's std added to its
attention output and MLP down projections (``aioengine.models.perturbed_weights``)."""
SWAP_AFTER_TOKENS = 12


@dataclass(slots=True)
class _Stream:
    prompt: str
    text: str = ""
    tokens: int = 0
    ttft: float | None = None
    done: float | None = None
    finish_reason: str | None = None


class _LiveLines:
    """One terminal line per request, redrawn in place as tokens arrive (only on a terminal)."""

    def __init__(self, streams: list[_Stream]) -> None:
        self.streams = streams
        self.last = 0.0
        print("\n" * (len(streams) - 1), flush=True)

    def draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < 0.05:
            return
        self.last = now
        width = shutil.get_terminal_size().columns - 1
        lines = [f"\x1b[{len(self.streams)}F"]
        for i, s in enumerate(self.streams):
            mark = "✓" if s.done is not None else "…"
            answer = "".join(c if c.isprintable() else " " for c in " ".join(s.text.split()))
            lines.append(f"\x1b[2K{_fit(f'  [{i}] {mark} {s.prompt} -> {answer}', width)}\n")
        sys.stdout.write("".join(lines))
        sys.stdout.flush()

    def close(self) -> None:
        self.draw(force=True)
        sys.stdout.write(f"\x1b[{len(self.streams)}F\x1b[J")  # the full answers replace the one-liners
        sys.stdout.flush()


def _columns(c: str) -> int:
    return 2 if unicodedata.east_asian_width(c) in "WF" else 1


def _fit(line: str, width: int) -> str:
    """``line`` cut to ``width`` terminal columns (wide CJK characters take two), so it never wraps."""
    if sum(map(_columns, line)) <= width:
        return line
    kept, used = [], 0
    for c in line:
        if used + _columns(c) > width - 3:
            break
        kept.append(c)
        used += _columns(c)
    return "".join(kept) + "..."


def _print_answer(index: int, s: _Stream) -> None:
    timing = f"{s.tokens} tokens, first after {s.ttft or 0:.2f}s, done at {s.done or 0:.2f}s, {s.finish_reason}"
    print(f"  [{index}] {s.prompt}  ({timing})")
    for paragraph in s.text.strip().splitlines() or [""]:
        print(textwrap.fill(paragraph, width=100, initial_indent="      ", subsequent_indent="      "))


def _request(chat: bool, prompt: str) -> dict[str, Any]:
    return {"messages": _messages(None, prompt)} if chat else {"prompt": prompt}


async def _concurrently(
    engine: AsyncEngine, prompts: Sequence[str], params: SamplingParams, chat: bool
) -> tuple[float, list[_Stream]]:
    """Streams every prompt at once; on a terminal each request's line updates live, elsewhere each answer
    is printed as its request finishes. Returns the wall seconds and the streams."""
    streams = [_Stream(p) for p in prompts]
    live = _LiveLines(streams) if sys.stdout.isatty() else None
    start = time.perf_counter()

    async def one(i: int) -> None:
        s = streams[i]
        async for out in engine.generate(params=params, **_request(chat, s.prompt)):
            now = time.perf_counter() - start
            if s.ttft is None and out.token_ids:
                s.ttft = now
            s.text, s.tokens = out.text, len(out.token_ids)
            if out.finished:
                s.done, s.finish_reason = now, out.finish_reason
                if live is None:
                    _print_answer(i, s)
            if live is not None:
                live.draw(force=out.finished)

    await asyncio.gather(*(one(i) for i in range(len(streams))))
    seconds = time.perf_counter() - start
    if live is not None:
        live.close()
        for i, s in enumerate(streams):
            _print_answer(i, s)
    return seconds, streams


async def _answer(engine: AsyncEngine, prompt: str, params: SamplingParams, chat: bool) -> Any:
    last = None
    async for out in engine.generate(params=params, **_request(chat, prompt)):
        last = out
    return last


def _flat(text: str) -> str:
    return " ".join(text.split())


async def _demo(args: argparse.Namespace, config: EngineConfig, model: _Model) -> int:
    from aioengine import models

    demo_start = time.perf_counter()
    rows: list[tuple[str, str]] = []
    async with AsyncEngine(config) as engine:
        ready = time.perf_counter() - demo_start
        info = engine.model_info
        assert info is not None
        chat = _has_chat_template(engine)
        weights = f"{model.name}" + ("" if model.real else " (random weights: expect gibberish)")
        device = "" if config.device.device == "auto" else f" on {config.device.device}"
        print(
            f"aioengine demo: {weights} ({info.architecture}, {info.num_layers} layers, {info.dtype}{device}); "
            f"engine ready in {ready:.1f}s"
        )
        rows.append(("engine start (load, KV cache, warm-up)", f"{ready:.2f} s"))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
        prompts: list[str] = args.prompt or DEMO_PROMPTS

        # 1. Concurrent streams.
        how = "in a chat template" if chat else "as plain text"
        print(
            f"\n1. {len(prompts)} requests at once ({how}, greedy, at most {params.max_tokens} tokens each), "
            "all in one batch; each answer shows as its request finishes:"
        )
        seconds, streams = await _concurrently(engine, prompts, params, chat)
        tokens = sum(s.tokens for s in streams)
        ttfts = [s.ttft for s in streams if s.ttft is not None]
        print(f"   {tokens} tokens from {len(streams)} requests in {seconds:.2f}s: {tokens / seconds:.1f} tokens/s")
        rows.append((f"{len(streams)} concurrent requests", f"{tokens} tokens in {seconds:.2f} s"))
        rows.append(("  output tokens/s, all requests together", f"{tokens / seconds:.1f}"))
        rows.append(("  time to first token p50 / max", f"{statistics.median(ttfts):.2f} s / {max(ttfts):.2f} s"))
        one_prompt = prompts[0]
        reference = await _answer(engine, one_prompt, params, chat)

        # The other weights of step 4, read and made on a thread while steps 2 and 3 run.
        other_task = asyncio.create_task(asyncio.to_thread(models.perturbed_weights, info.model_path, SWAP_NOISE))

        # 2. Sleep level 1 and wake; a request sent meanwhile waits.
        print("\n2. sleep(level=1) frees device memory and keeps the weights on the host; wake_up() brings it back.")
        slept = await engine.sleep(level=1)
        freed = slept.freed_bytes
        print(
            f"   sleep: freed {_mb(freed.total)} (weights {_mb(freed.weights)}, KV cache {_mb(freed.kv_cache)}) "
            f"in {slept.seconds:.3f}s" + "".join(f"\n   ({note})" for note in slept.notes)
        )
        sent_asleep = asyncio.create_task(_answer(engine, one_prompt, params, chat))
        await asyncio.sleep(0.2)
        waiting = engine.stats()
        woke = await engine.wake_up()
        late = await sent_asleep
        print(
            f"   a request sent while asleep waited ({waiting.requests_waiting + waiting.requests_held} waiting); "
            f"wake: {woke.seconds:.3f}s, then it ran: {_flat(late.text)!r}"
        )
        rows.append(("sleep level 1: freed / seconds", f"{_mb(freed.total)} / {slept.seconds:.3f} s"))
        rows.append(("  wake_up", f"{woke.seconds:.3f} s"))

        # 3. Sleep level 2 and reload.
        print("\n3. sleep(level=2) discards the weights too; after wake_up(), reload_weights() reads them again.")
        slept2 = await engine.sleep(level=2)
        freed2 = slept2.freed_bytes
        print(
            f"   sleep: freed {_mb(freed2.total)} (weights {_mb(freed2.weights)}, KV cache {_mb(freed2.kv_cache)}) "
            f"in {slept2.seconds:.3f}s"
        )
        woke2 = await engine.wake_up()
        reloaded = await engine.reload_weights()
        again = await _answer(engine, one_prompt, params, chat)
        same = again.token_ids == reference.token_ids
        print(
            f"   wake: {woke2.seconds:.3f}s, reload_weights: {reloaded.seconds:.2f}s ({_mb(reloaded.bytes)}, "
            f"weights_version {reloaded.weights_version}); the same answer as before: {same}"
        )
        rows.append(("sleep level 2: freed / seconds", f"{_mb(freed2.total)} / {slept2.seconds:.3f} s"))
        rows.append(("  wake_up + reload_weights", f"{woke2.seconds:.3f} s + {reloaded.seconds:.2f} s"))

        # 4. Hot weight swap and back.
        print(
            f"\n4. Hot weight swap to other weights of the same shape (the checkpoint with {SWAP_NOISE:.0%} noise "
            "on its o_proj / down_proj matrices), "
            "while a request streams, then back."
        )
        other = await other_task
        swap_params = SamplingParams(max_tokens=max(args.max_tokens, 2 * SWAP_AFTER_TOKENS), temperature=0)
        alone = time.perf_counter()
        before = await _answer(engine, SWAP_PROMPT, swap_params, chat)
        alone = time.perf_counter() - alone
        print(f"   prompt: {SWAP_PROMPT!r}")
        print(f"   before (weights_version {before.weights_version}): {_flat(before.text)!r}")
        pieces: list[str] = []
        version = None
        swap: asyncio.Task[Any] | None = None
        async for out in engine.generate(params=swap_params, **_request(chat, SWAP_PROMPT)):
            if out.weights_version != version:
                pieces.append(f" [v{out.weights_version}] ")
                version = out.weights_version
            pieces.append(out.delta_text)
            if swap is None and len(out.token_ids) >= SWAP_AFTER_TOKENS:
                swap = asyncio.create_task(engine.update_weights(other, mode="pause"))
        swapped = await swap if swap is not None else await engine.update_weights(other, mode="pause")
        del other
        print(f"   during (swapped after {SWAP_AFTER_TOKENS} tokens): {_flat(''.join(pieces))!r}")
        after = await _answer(engine, SWAP_PROMPT, swap_params, chat)
        print(f"   after  (weights_version {after.weights_version}): {_flat(after.text)!r}")
        back = await engine.reload_weights()
        restored = await _answer(engine, SWAP_PROMPT, swap_params, chat)
        print(
            f"   back   (weights_version {restored.weights_version}): {_flat(restored.text)!r}; "
            f"the same as before: {restored.token_ids == before.token_ids}"
        )
        print(
            f"   swap: {swapped.tensors} tensors, {_mb(swapped.bytes)} in {swapped.seconds:.2f}s "
            f"(no step ran for {swapped.pause_seconds:.2f}s); back: {back.seconds:.2f}s"
        )
        rows.append(
            ("hot swap (update_weights, pause)", f"{_mb(swapped.bytes)} in {swapped.seconds:.2f} s, paused "
             f"{swapped.pause_seconds:.2f} s")
        )  # fmt: skip
        rows.append(("  swap back (reload_weights)", f"{back.seconds:.2f} s"))
        single = f"{len(before.token_ids) / alone:.1f} (step 4's 'before')"
        rows.insert(3, ("  one request alone: tokens/s", single))
        stats = engine.stats()
    rows.append(("engine steps / preemptions", f"{stats.num_steps} / {stats.num_preemptions}"))
    rows.append(("whole demo (start to shutdown)", f"{time.perf_counter() - demo_start:.1f} s"))

    print("\n5. Summary")
    width = max(len(name) for name, _ in rows)
    print(f"   {'':{width}}  measured")
    print(f"   {'-' * width}  {'-' * max(len(v) for _, v in rows)}")
    for name, value in rows:
        print(f"   {name:{width}}  {value}")
    return 0
