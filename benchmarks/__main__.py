"""One entry point for every benchmark: ``python -m benchmarks <name> [options]``.

    python -m benchmarks throughput [--requests N] [--model tiny|small|real] [--out DIR]
    python -m benchmarks sleep_wake [--num-blocks N] [--device cpu]
    python -m benchmarks weight_swap [--streams N] [--keep DIR]

``python -m benchmarks <name> --help`` lists a benchmark's options. Each module also runs alone
(``python -m benchmarks.<name>``).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "throughput": "aioengine vs HF transformers: offline tokens/s, floors, online latency",
    "grpo": "an RL rollout (prompts x n samples): n = 8 vs separate requests vs HF, tokens/s, KV blocks",
    "prefix_cache": "prefix caching on vs off: shared system prompt, multi-turn chat, zero hits; tokens/s, TTFT",
    "preemption": "preemption by recompute vs swap for long contexts on a small KV cache: seconds per preemption",
    "sleep_wake": "sleep and wake seconds per level beside a memcpy floor",
    "weight_swap": "hot weight swap seconds and stream gaps beside disk floors",
    "serving": "HTTP overhead: streamed /v1/completions vs AsyncEngine.generate per concurrency; req/s, TTFT, ITL",
    "startup": "seconds from AsyncEngine(...) to the first token, cold (fresh process) and warm",
    "gemm": "the linear layers' GEMMs alone per row count: F.linear vs oneDNN vs the row-block GEMM; GFLOP/s",
    "tp": "tensor parallelism: TP=1 vs TP=2 on the mp executor; tokens/s, communication share, calls per step",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = "\n".join(f"  {name:<{width}}  {what}" for name, what in COMMANDS.items())
    return f"usage: python -m benchmarks <name> [options]\n\nbenchmarks:\n{lines}"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    name = argv[0].replace("-", "_")
    if name not in COMMANDS:
        print(f"unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(f"benchmarks.{name}")
    sys.argv = [f"python -m benchmarks {name}", *argv[1:]]  # the modules parse sys.argv themselves
    module.main()


if __name__ == "__main__":
    main()
