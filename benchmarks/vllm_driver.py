"""vLLM's CPU engine over one workload, timed: run by the vLLM venv's python, not the project's.

    /tmp/vllm-venv/bin/python benchmarks/vllm_driver.py SPEC.json          # `repeats` timed runs, one line
    /tmp/vllm-venv/bin/python benchmarks/vllm_driver.py - < SPEC.json       # the same, the spec on stdin
    /tmp/vllm-venv/bin/python benchmarks/vllm_driver.py SPEC.json --serve  # one timed run per "run" line

It imports only vllm and the standard library (vLLM pins its own torch and transformers, so it lives in
a venv of its own; benchmarks/vllm_cpu.py is the side that runs it). The spec is a JSON object:

    {"model": "/path/to/checkpoint", "prompts": [[token ids], ...], "max_tokens": [n, ...],
     "llm": {"enforce_eager": true, "max_num_seqs": 64, "max_num_batched_tokens": 512, ...},
     "seed": 0, "repeats": 1}

``llm`` goes to ``vllm.LLM`` as keyword arguments, on top of ``skip_tokenizer_init=True`` and
``dtype="float32"`` (the random-init checkpoints have a tokenizer smaller than their vocabulary, so the
prompts go in as token ids). Every request is greedy with EOS ignored and ``min_tokens = max_tokens``;
a run whose requests did not each produce exactly their ``max_tokens`` is reported with ``short > 0``.

stdout carries only JSON lines (vLLM's own log goes to stderr): ``{"driver": "vllm", "event": "ready",
...}`` after start-up and warm-up, one ``"event": "run"`` line per timed run in ``--serve`` mode, and a
final ``"event": "done"`` line with every run. Seconds everywhere.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for the JSON lines


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"driver": "vllm", "event": event, **fields}), flush=True)


def _tree_pids(root: int) -> set[int]:
    """``root`` and every process below it (vLLM's engine core and worker run as child processes)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def _cpu_seconds(pids: set[int]) -> float:
    """User + system CPU of ``pids`` so far."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, ValueError, IndexError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def _machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def build(spec: dict[str, Any]) -> Any:
    """The ``vllm.LLM`` the spec asks for (start-up: loading, KV cache, any compilation, warm-up)."""
    from vllm import LLM  # type: ignore[import-not-found]  # the vLLM venv's, not ours

    kwargs = {"skip_tokenizer_init": True, "dtype": "float32", "seed": spec.get("seed", 0), **spec.get("llm", {})}
    return LLM(model=spec["model"], **kwargs)


def generate(llm: Any, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, int, int]:
    """One generate over every request: (seconds, output tokens, requests short of their max_tokens)."""
    from vllm import SamplingParams  # type: ignore[import-not-found]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [
        SamplingParams(temperature=0, ignore_eos=True, max_tokens=n, min_tokens=n, detokenize=False) for n in max_tokens
    ]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counts = [len(o.outputs[0].token_ids) for o in outputs]
    short = sum(1 for c, n in zip(counts, max_tokens, strict=True) if c != n)
    return seconds, sum(counts), short


def timed_run(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """One timed generate, with the CPU the rest of the machine spent meanwhile (cores)."""
    pids = _tree_pids(os.getpid())
    busy, own = _machine_busy_seconds(), _cpu_seconds(pids)
    start = time.perf_counter()
    seconds, tokens, short = generate(llm, spec["prompts"], spec["max_tokens"])
    wall = time.perf_counter() - start
    after = _machine_busy_seconds()
    others = None
    if busy is not None and after is not None and wall > 0:
        others = max(0.0, (after - busy - (_cpu_seconds(pids) - own)) / wall)
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "short": short,
        "others_load": others,
    }


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    spec = json.load(sys.stdin) if argv[0] == "-" else json.loads(Path(argv[0]).read_text())
    serve = "--serve" in argv[1:]
    if serve and argv[0] == "-":
        sys.exit("--serve reads its commands from stdin: give the spec as a file")

    start = time.perf_counter()
    import vllm  # type: ignore[import-not-found]

    imported = time.perf_counter() - start
    start = time.perf_counter()
    llm = build(spec)
    startup = time.perf_counter() - start
    start = time.perf_counter()
    generate(llm, [spec["prompts"][0][:16]], [2])  # warm-up, untimed, as every system gets
    warmup = time.perf_counter() - start

    import torch

    info = {
        "import_seconds": imported,
        "startup_seconds": startup,
        "warmup_seconds": warmup,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "driver_torch_threads": torch.get_num_threads(),  # the engine's own, where it runs in process
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }
    _emit("ready", **info)
    runs = []
    if serve:
        for line in sys.stdin:
            if line.strip() != "run":
                break
            runs.append(timed_run(llm, spec))
            _emit("run", **runs[-1])
    else:
        runs = [timed_run(llm, spec) for _ in range(int(spec.get("repeats", 1)))]
    _emit("done", **info, runs=runs)


if __name__ == "__main__":
    main(sys.argv[1:])
