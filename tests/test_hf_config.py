"""``config.json`` read without transformers must mean what transformers' AutoConfig makes of it.

Every field the engine reads is compared with AutoConfig's object on the same file: saved checkpoints of
every supported architecture (every key written out), the real model, and sparse configs that leave
most values to the class defaults, the legacy 4.x rope keys, and the sliding-window switches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from aioengine.errors import CheckpointError, UnsupportedModelError
from aioengine.model.hf_config import CheckpointConfig, load_hf_config
from aioengine.model.layers import compute_inv_freq
from aioengine.testing import SUPPORTED_TEST_ARCHS, build_checkpoint

ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

SPARSE: list[dict[str, Any]] = [
    {},
    {"hidden_size": 256, "num_attention_heads": 4},
    {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    {"rope_theta": 500000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "eos_token_id": [7, 9]},
    {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1e6},
    {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}},
    {"partial_rotary_factor": 0.5},
    {"sliding_window": 1024},
    {"sliding_window": 1024, "use_sliding_window": True},
    {"sliding_window": None, "use_sliding_window": True},
    {"attention_bias": True, "hidden_act": "gelu", "max_position_embeddings": 4096},
    {"torch_dtype": "bfloat16"},
    {"dtype": "float16", "vocab_size": 1000},
]


def hf_view(cfg: Any) -> dict[str, Any]:
    """What the engine reads, taken from transformers' config object."""
    heads = cfg.num_attention_heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    dtype = getattr(cfg, "dtype", None)
    return {
        "architectures": tuple(cfg.architectures),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": getattr(cfg, "attention_bias", False),
        "rope_type": rope.get("rope_type"),
        "rope_theta": rope.get("rope_theta"),
        "partial_rotary_factor": rope.get("partial_rotary_factor"),
        "rope_factor": rope.get("factor"),
        "sliding_window": getattr(cfg, "sliding_window", None),
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "eos_token_id": cfg.eos_token_id,
    }


def our_view(cfg: CheckpointConfig) -> dict[str, Any]:
    rope = cfg.rope_parameters
    return {
        "architectures": cfg.architectures,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "rope_type": rope.get("rope_type"),
        "rope_theta": rope.get("rope_theta"),
        "partial_rotary_factor": rope.get("partial_rotary_factor"),
        "rope_factor": rope.get("factor"),
        "sliding_window": cfg.sliding_window,
        "dtype": cfg.dtype,
        "eos_token_id": cfg.eos_token_id,
    }


def assert_same_as_transformers(path: Path) -> None:
    theirs = hf_view(AutoConfig.from_pretrained(str(path), local_files_only=True))
    ours = our_view(load_hf_config(path))
    assert ours == theirs


@pytest.mark.parametrize("arch", SUPPORTED_TEST_ARCHS)
def test_a_saved_checkpoint_config_reads_as_transformers_reads_it(arch: str, tmp_path: Path) -> None:
    path = build_checkpoint(tmp_path / arch, arch, num_layers=1)
    assert_same_as_transformers(path)


def test_the_real_model_config_reads_as_transformers_reads_it(real_model: Path) -> None:
    assert_same_as_transformers(real_model)


@pytest.mark.parametrize("fields", SPARSE, ids=lambda f: ",".join(f) or "defaults")
@pytest.mark.parametrize("model_type", list(ARCHS))
def test_a_sparse_config_takes_the_class_defaults_transformers_takes(
    model_type: str, fields: dict[str, Any], tmp_path: Path
) -> None:
    raw = {"architectures": [ARCHS[model_type]], "model_type": model_type, **fields}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert_same_as_transformers(tmp_path)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # Mistral's and Qwen3's classes refuse None here
def test_null_kv_heads_and_head_dim_are_derived_as_transformers_derives_them(model_type: str, tmp_path: Path) -> None:
    raw = {"architectures": [ARCHS[model_type]], "model_type": model_type, "num_key_value_heads": None}
    (tmp_path / "config.json").write_text(json.dumps(raw | {"head_dim": None}))
    assert_same_as_transformers(tmp_path)


def write(tmp_path: Path, raw: Any) -> Path:
    (tmp_path / "config.json").write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    ("raw", "error", "words"),
    [
        ("{not json", CheckpointError, ["config.json"]),
        ([1, 2], CheckpointError, ["config.json", "list"]),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, UnsupportedModelError, ["GPT2LMHeadModel"]),
        ({"architectures": ["LlamaForCausalLM"]}, UnsupportedModelError, ["model_type", "None"]),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": "big"}, CheckpointError,
         ["hidden_size", "'big'"]),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 0}, CheckpointError,
         ["num_hidden_layers", "positive"]),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": "x"}, CheckpointError,
         ["rms_norm_eps"]),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_scaling": 3}, CheckpointError,
         ["rope"]),
    ],
)  # fmt: skip
def test_a_config_that_cannot_be_read_is_an_error_naming_the_problem(
    raw: Any, error: type[Exception], words: list[str], tmp_path: Path
) -> None:
    with pytest.raises(error) as info:
        load_hf_config(write(tmp_path, raw))
    assert all(word in str(info.value) for word in words), str(info.value)


def test_reading_a_config_does_not_import_transformers(llama_ckpt: Path) -> None:
    code = (
        "import sys\n"
        "from aioengine.model.hf_config import load_hf_config\n"
        f"cfg = load_hf_config({str(llama_ckpt)!r})\n"
        "assert cfg.num_hidden_layers > 0\n"
        "print('transformers' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 1024},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    ],
    ids=lambda r: r["rope_type"],
)  # fmt: skip
def test_a_scaled_rope_gives_the_frequencies_of_transformers_rotary_embedding(
    rope: dict[str, Any], tmp_path: Path
) -> None:
    # Scaled types go through transformers' own functions, handed transformers' config for our file.
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(raw | {"rope_scaling": rope}))
    inv_freq, scaling = compute_inv_freq(load_hf_config(tmp_path), 64)
    reference = LlamaRotaryEmbedding(AutoConfig.from_pretrained(str(tmp_path)))
    assert torch.equal(inv_freq, reference.inv_freq.float())
    assert scaling == pytest.approx(reference.attention_scaling)
