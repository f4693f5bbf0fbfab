"""Offline throughput: aioengine vs HF transformers ``generate`` on the same checkpoint, same run.

    python -m benchmarks.throughput [--requests 32] [--model tiny]

Workload: prompts of U[16, 256] tokens, outputs of U[16, 128] tokens (numpy rng seed 0), greedy,
EOS ignored. HF runs static batches with left padding; its output tokens count only the tokens
each request asked for, so both sides are credited the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from aioengine import AsyncEngine, EngineConfig, SamplingParams
from aioengine.testing import build_checkpoint

MODELS = {
    "tiny": dict(arch="llama", hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, num_kv_heads=2,
                 vocab_size=32000),
}  # fmt: skip


def workload(n: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(0)
    return [
        (rng.integers(3, vocab, int(rng.integers(16, 257))).tolist(), int(rng.integers(16, 129))) for _ in range(n)
    ]


async def run_aioengine(path: Path, reqs: list[tuple[list[int], int]]) -> float:
    config = EngineConfig(model={"path": str(path), "dtype": "float32"}, device={"device": "cpu"},
                          scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 512})  # fmt: skip
    async with AsyncEngine(config) as engine:
        async def one(prompt: list[int], n: int) -> int:
            count = 0
            async for out in engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)):
                count = len(out.token_ids)
            return count

        start = time.perf_counter()
        worker0 = engine.stats()["worker_seconds"]
        tokens = sum(await asyncio.gather(*(one(p, n) for p, n in reqs)))
        wall = time.perf_counter() - start
        busy = engine.stats()["worker_seconds"] - worker0
        print(f"aioengine: {engine.stats()['num_steps']} steps, worker busy {busy:.2f}s of {wall:.2f}s wall "
              f"(efficiency {busy / wall:.2f})")
        return tokens / wall


def run_hf(path: Path, reqs: list[tuple[list[int], int]], batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)  # fmt: skip
        tokens += sum(n for _, n in batch)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--hf-batch-sizes", default="8,32")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(MODELS[args.model])
        path = build_checkpoint(Path(tmp) / args.model, spec.pop("arch"), **spec)  # type: ignore[arg-type]
        reqs = workload(args.requests, int(spec["vocab_size"]))
        ours = asyncio.run(run_aioengine(path, reqs))
        rows = [("aioengine", ours, 1.0)]
        for bs in (int(b) for b in args.hf_batch_sizes.split(",") if b):
            hf = run_hf(path, reqs, bs)
            rows.append((f"HF generate, static batch {bs}", hf, ours / hf))
    print(f"\n{args.requests} requests, model {args.model}, float32 CPU, {torch.get_num_threads()} threads\n")
    print("| system | output tokens/s | aioengine / system |\n|---|---:|---:|")
    for name, tps, ratio in rows:
        print(f"| {name} | {tps:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
