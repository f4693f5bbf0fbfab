"""The core correctness spec: greedy tokens are identical to HF transformers ``generate``.

Same random-init checkpoint, float32 on both sides. The engine serves every prompt at once
(continuous batching, concurrent consumers); HF runs them one at a time with no padding, so
any difference comes from the engine: paged attention, chunked prefill, preemption, batching.
"""

from __future__ import annotations

import asyncio
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from aioengine import AsyncEngine
from aioengine.messages import PLACEHOLDER_TOKEN_ID
from aioengine.sampling.params import SamplingParams
from aioengine.testing import build_checkpoint, build_tokenizer
from tests.helpers import hf_generate

NUM_PROMPTS = 16
MAX_PROMPT_LEN = 200
NEW_TOKENS = 32
SMALL_BUDGET = 48  # tokens per step: every prompt longer than this is prefilled in chunks
SMALL_CACHE_BLOCKS = 40  # x 16 tokens = 640: far less than 16 requests of up to 232 tokens need

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {"cache": {"num_blocks": 512}, "scheduler": {"max_num_batched_tokens": 512}},
    "chunked": {"cache": {"num_blocks": 512}, "scheduler": {"max_num_batched_tokens": SMALL_BUDGET}},
    "preempt": {"cache": {"num_blocks": SMALL_CACHE_BLOCKS, "block_size": 16}},
    # Every config above schedules asynchronously (the default); this one steps one at a time, preempting.
    "sync": {"cache": {"num_blocks": SMALL_CACHE_BLOCKS, "block_size": 16}, "scheduler": {"async_scheduling": False}},
}


def random_prompts(num: int, seed: int) -> list[list[int]]:
    """``num`` prompts of random lengths 1..MAX_PROMPT_LEN, ids in [3, len(tokenizer)) (no specials)."""
    vocab = len(build_tokenizer())
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_PROMPT_LEN + 1, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """HF's greedy continuation of each prompt, one prompt at a time, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return hf_generate(model, prompts, new_tokens)


async def engine_greedy(engine: AsyncEngine, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Every prompt submitted at once, each stream consumed by its own task."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    async def consume(prompt: list[int]) -> list[int]:
        last = None
        async for out in engine.generate(prompt, params):
            last = out
        assert last is not None and last.finished and last.finish_reason == "length"
        return last.token_ids

    return list(await asyncio.gather(*(consume(p) for p in prompts)))


def assert_same_tokens(got: list[list[int]], want: list[list[int]]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(w) == NEW_TOKENS, f"HF gave {len(w)} tokens for prompt {i}"
        assert g == w, f"prompt {i} ({len(PROMPTS[i])} tokens): engine {g} != HF {w}"


def record_steps(engine: AsyncEngine) -> list[Any]:
    """Wraps the executor so every SchedulerOutput sent to the worker is kept for inspection."""
    assert engine.executor is not None
    steps: list[Any] = []
    execute = engine.executor.submit_step

    def recording(sched: Any) -> Any:
        steps.append(sched)
        return execute(sched)

    engine.executor.submit_step = recording  # type: ignore[method-assign]
    return steps


PROMPTS = random_prompts(NUM_PROMPTS, seed=1234)


@pytest.fixture(scope="module")
def hf_reference(llama_ckpt: Path, qwen2_ckpt: Path) -> Callable[[str], tuple[Path, list[list[int]]]]:
    cache: dict[str, tuple[Path, list[list[int]]]] = {}
    paths = {"llama": llama_ckpt, "qwen2": qwen2_ckpt}

    def get(arch: str) -> tuple[Path, list[list[int]]]:
        if arch not in cache:
            cache[arch] = (paths[arch], hf_greedy(paths[arch], PROMPTS))
        return cache[arch]

    return get


def test_prompts_cover_chunking_and_preemption() -> None:
    # The configurations below only test what they claim if the prompts are this varied.
    lengths = [len(p) for p in PROMPTS]
    assert min(lengths) >= 1 and max(lengths) <= MAX_PROMPT_LEN
    assert sum(n > SMALL_BUDGET for n in lengths) >= 4
    blocks_needed = sum(math.ceil((n + NEW_TOKENS) / 16) for n in lengths)
    assert blocks_needed > 2 * SMALL_CACHE_BLOCKS


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
async def test_concurrent_greedy_matches_hf_generate(
    arch: str, config: str, hf_reference: Callable[[str], tuple[Path, list[list[int]]]], make_engine: Any
) -> None:
    path, want = hf_reference(arch)
    async with make_engine(path, **CONFIGS[config]) as engine:
        steps = record_steps(engine)
        got = await engine_greedy(engine, PROMPTS)
        stats = engine.stats()
        assert_same_tokens(got, want)
        assert stats.kv_blocks_free == stats.kv_blocks_total
        assert stats.requests_running == 0 and stats.requests_waiting == 0

    assert max(len(s.requests) for s in steps) > 1, "requests never shared a step"
    budget = CONFIGS[config].get("scheduler", {}).get("max_num_batched_tokens", 512)
    assert all(s.num_tokens <= budget for s in steps)
    if config == "chunked":
        # Each request computes its prompt and all but its last output token; 48 a step at most.
        total = sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)
        assert stats.num_steps >= math.ceil(total / SMALL_BUDGET)
        continued = [r for s in steps for r in s.requests if r.start_pos > 0 and len(r.token_ids) > 1]
        assert continued, "no prefill chunk continued a prompt: chunked prefill did not happen"
    if config in ("preempt", "sync"):
        assert stats.num_preemptions > 0
    placeholders = any(PLACEHOLDER_TOKEN_ID in r.token_ids for s in steps for r in s.requests)
    assert placeholders == (config != "sync"), "async scheduling on exactly when configured"


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
async def test_greedy_matches_hf_generate_for_arch(
    arch: str, tmp_path_factory: pytest.TempPathFactory, make_engine: Any
) -> None:
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt") / arch, arch)
    prompts = PROMPTS[:6]
    want = hf_greedy(path, prompts)
    async with make_engine(path) as engine:
        got = await engine_greedy(engine, prompts)
        stats = engine.stats()
    assert_same_tokens(got, want)
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_sharded_checkpoint_matches_hf_generate(
    tmp_path_factory: pytest.TempPathFactory, make_engine: Any
) -> None:
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama-sharded", "llama", num_shards=3)
    assert len(list(path.glob("*.safetensors"))) == 3 and (path / "model.safetensors.index.json").is_file()
    prompts = PROMPTS[:6]
    want = hf_greedy(path, prompts)
    async with make_engine(path) as engine:
        got = await engine_greedy(engine, prompts)
    assert_same_tokens(got, want)


async def test_greedy_past_an_argmax_eos_matches_hf_generate(
    llama_ckpt: Path, tmp_path: Path, make_engine: Any
) -> None:
    # Make EOS the favourite now and then: ignore_eos must emit it and go on, exactly as HF does.
    path = Path(shutil.copytree(llama_ckpt, tmp_path / "eos-prone"))
    tensors = load_file(str(path / "model.safetensors"))
    eos = build_tokenizer().eos_token_id
    tensors["lm_head.weight"][eos] *= 4
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    prompts = PROMPTS[:4]
    want = hf_greedy(path, prompts)
    assert any(eos in w[:-1] for w in want), "EOS never won: the test would not test ignore_eos"

    async with make_engine(path) as engine:
        got = await engine_greedy(engine, prompts)
    assert_same_tokens(got, want)
