"""What a user would run instead: HF transformers ``generate`` in static batches, and HF's own
continuous batching (``ContinuousBatchingManager``, behind ``generate_batch``).

Both get the same checkpoint, float32, greedy, EOS ignored, and are credited only the tokens each
request asked for (a static batch computes up to its longest request; the padding is its cost).
Model loading and one-off warm-up are outside the timings, as the engine's start is.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cpu_load import CpuLoad
from benchmarks.results import SystemResult
from benchmarks.workload import BenchRequest, output_tokens


def load_hf(path: Path) -> Any:
    """The checkpoint as an HF ``*ForCausalLM`` in float32, eval mode (a fresh copy per system)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def _generate_batch(model: Any, batch: list[BenchRequest]) -> None:
    width = max(len(r.prompt) for r in batch)
    ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch])
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
    new = max(r.max_tokens for r in batch)
    # min_new_tokens = max_new_tokens keeps EOS from ending any row early.
    model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
    )


def run_hf_static(path: Path, reqs: list[BenchRequest], batch_size: int) -> SystemResult:
    """``model.generate`` over the requests in order, ``batch_size`` at a time, left padded."""
    model = load_hf(path)
    _generate_batch(model, [BenchRequest(reqs[0].prompt[:16], 2)])  # warm-up, untimed
    with CpuLoad() as load:
        start = time.perf_counter()
        for i in range(0, len(reqs), batch_size):
            _generate_batch(model, reqs[i : i + batch_size])
        seconds = time.perf_counter() - start
    note = f"only {len(reqs)} requests" if batch_size > len(reqs) else ""
    name = f"HF generate, static batch {batch_size}"
    return SystemResult(name, output_tokens(reqs) / seconds, seconds, note, load.others)


def run_hf_continuous(path: Path, reqs: list[BenchRequest], max_batch_tokens: int, max_seqs: int) -> SystemResult:
    """HF's continuous batching with the engine's limits (tokens per step, sequences per step), its KV
    cache sized so every request fits at once. Timed from the first request in to the last result out."""
    name = "HF continuous batching"
    try:
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig
    except ImportError as exc:
        return SystemResult(name, None, None, f"not available ({exc})")
    model = load_hf(path)
    if not hasattr(model, "continuous_batching_context_manager"):
        return SystemResult(name, None, None, "not available in this transformers version")
    page = 256
    blocks = sum(-(-(len(r.prompt) + r.max_tokens) // page) for r in reqs) + 8
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs), eos_token_id=-1, pad_token_id=0
    )
    cb = ContinuousBatchingConfig(
        page_size=page, num_blocks=blocks, max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_seqs
    )
    done: dict[str, int] = {}
    with (
        model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, warmup=True
        ) as manager,
        CpuLoad() as load,
    ):
        start = time.perf_counter()
        for i, r in enumerate(reqs):
            manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
        while len(done) < len(reqs):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    return SystemResult(name, None, None, f"failed: {len(done)}/{len(reqs)} requests finished")
                continue
            if result.is_finished():
                done[result.request_id] = len(result.generated_tokens)
        seconds = time.perf_counter() - start
    short = sum(1 for i, r in enumerate(reqs) if done[f"r{i}"] != r.max_tokens)
    note = f"{short} requests got a different token count" if short else f"KV pages of {page} tokens"
    return SystemResult(name, output_tokens(reqs) / seconds, seconds, note, load.others)
