"""Shared set-up of the request tests: helpers and checkpoints built to provoke EOS and undecodable ids.

The fixtures here reach every test module through ``pytest_plugins`` in conftest.py; the modules import
the constants and helpers they use by name."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from aioengine import RequestOutput, SamplingParams

PROMPT = "The quick brown fox"
SEEDED = {"temperature": 0.8, "top_p": 0.9, "ignore_eos": True}
LONG = 2000
"""max_tokens of a request that must be ended early: it could not finish by itself within a test."""


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def decoded(tokenizer: Any, token_ids: list[int]) -> str:
    """What the tokenizer alone makes of the ids it knows (the model's vocab is larger)."""
    return tokenizer.decode([t for t in token_ids if t < len(tokenizer)], skip_special_tokens=True)


def assert_text_is_the_decoded_ids(text: str, full: str) -> None:
    # A trailing byte sequence that never became a whole character is not streamed: it is the
    # only difference allowed between the streamed text and the tokenizer's own decoding.
    assert full.startswith(text) and set(full[len(text) :]) <= {"\ufffd"}, (text, full)


def assert_deltas_build_the_text(outputs: list[RequestOutput]) -> None:
    """Every delta extends what was streamed before, and the deltas add up to the final text."""
    text = outputs[-1].text
    streamed = ""
    for out in outputs:
        streamed += out.delta_text
        assert text.startswith(streamed), f"streamed {streamed!r} is not a prefix of final text {text!r}"
    assert streamed == text
    assert [t for out in outputs for t in out.delta_token_ids] == outputs[-1].token_ids


@pytest.fixture(scope="module")
def tokenizer(llama_ckpt: Path) -> Any:
    return AutoTokenizer.from_pretrained(llama_ckpt)


def edited_checkpoint(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of ``src`` whose tensors went through ``edit`` (in place)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("aioengine_checkpoint.json"))  # no longer what it says
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def eos_ckpt(llama_ckpt: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama_ckpt whose lm_head row for EOS is 1.05x the row of a token that greedy decoding of
    PROMPT produces within 4 steps: wherever that token would win with a positive logit, EOS
    wins instead, so greedy decoding of PROMPT must reach EOS within 4 tokens.

    The favoured token is found with transformers itself, not with the engine.
    """
    model = AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32)
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    favoured = ids[-1]

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"][tokenizer.eos_token_id] = tensors["lm_head.weight"][favoured] * 1.05

    return edited_checkpoint(llama_ckpt, tmp_path_factory.mktemp("eos") / "llama", edit)


@pytest.fixture(scope="module")
def undecodable_ckpt(llama_ckpt: Path, tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama_ckpt whose lm_head favours the ids the tokenizer does not have (3x their rows)."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"][len(tokenizer) :] *= 3.0

    return edited_checkpoint(llama_ckpt, tmp_path_factory.mktemp("undecodable") / "llama", edit)
