"""Shared set-up of the weight-swap tests: checkpoints A and B, HF references, helpers.

The fixtures here reach every test module through ``pytest_plugins`` in conftest.py; the modules import
the constants and helpers they use by name."""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from aioengine import AsyncEngine, RequestOutput, SamplingParams
from aioengine.model.packing import dense_parameters
from aioengine.testing import build_checkpoint, build_tokenizer
from tests.helpers import TIMEOUT, hf_generate

NEW_TOKENS = 24
NUM_STREAMS = 30
NUM_LATE = 5
"""Requests sent while a swap is in progress (prompts 0..4 again, under new request ids)."""
FEW = 6
"""Prompts checked after a swap outside the concurrency tests."""
MODES = ["pause", "drain", "abort", "recompute"]


def random_prompts(num: int, seed: int, max_len: int = 24) -> list[list[int]]:
    """``num`` prompts of 1..max_len random ids, none of them a special token."""
    vocab = len(build_tokenizer())
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = random_prompts(NUM_STREAMS, seed=4321)


# ---- references ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def hf_model(path: Path, round_trip: torch.dtype | None = None) -> Any:
    """HF's float32 model of ``path``; with ``round_trip`` its parameters are rounded to that dtype first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if round_trip is not None:  # parameters only: model.to() would also round the rotary buffers
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(round_trip))
    return model


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int | list[int] = NEW_TOKENS,
              round_trip: torch.dtype | None = None) -> list[list[int]]:  # fmt: skip
    """HF's greedy continuation of each prompt, one prompt at a time, EOS ignored."""
    return hf_generate(hf_model(path, round_trip), prompts, new_tokens)


@pytest.fixture(scope="session")
def ckpt_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama-b", "llama", seed=1)


@pytest.fixture(scope="session")
def ref(llama_ckpt: Path, ckpt_b: Path) -> dict[str, list[list[int]]]:
    """HF greedy tokens of every prompt under checkpoint "A" (the engine's) and "B"."""
    return {"A": hf_greedy(llama_ckpt, PROMPTS), "B": hf_greedy(ckpt_b, PROMPTS)}


@pytest.fixture
async def engine(llama_ckpt: Path, make_engine: Callable[..., AsyncEngine]) -> Any:
    async with make_engine(llama_ckpt) as engine:
        yield engine


# ---- helpers ---------------------------------------------------------------------------------------
def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def final(engine: AsyncEngine, prompt: list[int], params: SamplingParams | None = None) -> RequestOutput:
    out = None
    async with asyncio.timeout(TIMEOUT):
        async for item in engine.generate(prompt, params or greedy()):
            out = item
    assert out is not None and out.finished
    return out


async def token_ids(engine: AsyncEngine, prompts: list[list[int]] = PROMPTS[:FEW]) -> list[list[int]]:
    outs = await asyncio.gather(*(final(engine, p) for p in prompts))
    return [list(o.token_ids) for o in outs]


def _param_checksums(worker: Any) -> dict[str, str]:
    return {
        name: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, p in dense_parameters(worker.model_runner.model).items()
    }


async def checksums(engine: AsyncEngine) -> dict[str, str]:
    """sha256 of every parameter's bytes, computed on the worker thread between steps."""
    return (await engine.collective_rpc(_param_checksums))[0]


def b_tensors(ckpt: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    tensors = load_file(str(ckpt / "model.safetensors"))
    return tensors if dtype is None else {n: t.to(dtype) for n, t in tensors.items()}
