"""Command line: ``aioengine demo`` and ``aioengine generate --model DIR --prompt ...`` (on uvloop)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from typing import Any

from aioengine.config import EngineConfig
from aioengine.engine.async_engine import AsyncEngine
from aioengine.engine.sync import new_event_loop
from aioengine.sampling.params import SamplingParams

DEMO_PROMPTS = ["Once upon a time", "The engine woke up and", "Asyncio lets one thread"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aioengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("demo", "generate with the embedded default model (built locally once, then cached)"),
        ("generate", "generate from an HF checkpoint directory"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        if name == "generate":
            p.add_argument("--model", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
            p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
        else:
            p.add_argument(
                "--prompt", action="append", help="a prompt; repeat for several (default: three demo prompts)"
            )
        p.add_argument("--config", help="TOML config file (see config.example.toml)")
        p.add_argument("--max-tokens", type=int, default=48)
        p.add_argument("--temperature", type=float, default=0.8)
        p.add_argument("--top-p", type=float, default=0.95)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
        p.add_argument("-v", "--verbose", action="store_true", help="log engine start-up")
    return parser


async def _run(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    if getattr(args, "model", None):
        overrides["model"] = {"path": args.model}
    if args.device:
        overrides["device"] = {"device": args.device}
    config = EngineConfig.from_toml(args.config, **overrides) if args.config else EngineConfig(**overrides)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    prompts = args.prompt or DEMO_PROMPTS
    if config.model.path is None:
        print("aioengine: using the embedded demo model (random weights: expect gibberish text)", file=sys.stderr)
    async with AsyncEngine(config) as engine:
        start = time.perf_counter()
        finals = await asyncio.gather(
            *(_stream(engine, i, p, params, len(prompts) == 1) for i, p in enumerate(prompts))
        )
        seconds = time.perf_counter() - start
        tokens = sum(len(out.token_ids) for out in finals)
        if len(prompts) > 1:
            for i, (prompt, out) in enumerate(zip(prompts, finals, strict=True)):
                print(f"[{i}] {prompt!r} -> {out.text!r} ({out.finish_reason})")
        print(f"\n{tokens} tokens from {len(prompts)} requests in {seconds:.2f}s: {tokens / seconds:.1f} tokens/s")
    return 0


async def _stream(engine: AsyncEngine, index: int, prompt: str, params: SamplingParams, live: bool) -> Any:
    last = None
    if live:
        print(prompt, end="", flush=True)
    async for out in engine.generate(prompt, params):
        if live:
            print(out.delta_text, end="", flush=True)
        last = out
    if live:
        print()
    return last


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    loop = new_event_loop()
    try:
        return loop.run_until_complete(_run(args))
    finally:
        loop.close()


if __name__ == "__main__":
    raise SystemExit(main())
