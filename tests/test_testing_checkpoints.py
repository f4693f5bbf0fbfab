"""Specification of ``aioengine.testing``: locally built random-init checkpoints in genuine HF format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from aioengine.testing import SUPPORTED_TEST_ARCHS, build_checkpoint, build_tokenizer, default_model_dir

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


@pytest.mark.parametrize("arch", SUPPORTED_TEST_ARCHS)
def test_each_arch_builds_a_checkpoint_transformers_loads(tmp_path: Path, arch: str) -> None:
    path = build_checkpoint(tmp_path / arch, arch)
    assert (path / "model.safetensors").is_file() and not list(path.glob("*.bin"))
    assert (path / "generation_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.architectures == [ARCHITECTURES[arch]]
    assert type(model).__name__ == ARCHITECTURES[arch]
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.dtype == torch.float32


def test_qwen2_ties_embeddings_and_has_qkv_bias(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(build_checkpoint(tmp_path / "q2", "qwen2"))
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_qwen3_has_qk_norm_and_explicit_head_dim(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(build_checkpoint(tmp_path / "q3", "qwen3"))
    assert model.config.head_dim == 64 // 4
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (16,)
    assert model.model.layers[0].self_attn.q_proj.bias is None


def test_llama_and_mistral_are_untied(tmp_path: Path) -> None:
    for arch in ("llama", "mistral"):
        config = AutoConfig.from_pretrained(build_checkpoint(tmp_path / arch, arch))
        assert not config.tie_word_embeddings
    assert AutoConfig.from_pretrained(tmp_path / "mistral").sliding_window is None


def test_same_seed_gives_byte_identical_weights(tmp_path: Path, llama_dir: Path) -> None:
    again = build_checkpoint(tmp_path / "again", "llama", seed=0)
    other = build_checkpoint(tmp_path / "other", "llama", seed=1)
    weights = (llama_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights
    assert (again / "tokenizer.json").read_bytes() == (llama_dir / "tokenizer.json").read_bytes()


def test_num_shards_writes_hf_index_and_loads(tmp_path: Path, llama_dir: Path) -> None:
    path = build_checkpoint(tmp_path / "sharded", "llama", num_shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all((path / name).is_file() for name in shards)
    assert not (path / "model.safetensors").exists()
    sharded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    single = AutoModelForCausalLM.from_pretrained(llama_dir).state_dict()
    assert all(torch.equal(sharded[name], single[name]) for name in single)


@pytest.mark.parametrize("text", ["Hello, world!", "naïve café", "日本語のテキスト", "emoji 🤖🚀", ""])
def test_tokenizer_round_trips_utf8(llama_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_is_deterministic_with_named_special_tokens() -> None:
    first, second = build_tokenizer(), build_tokenizer()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert (first.bos_token, first.eos_token, first.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert len(first) == 1024


def test_model_vocab_is_larger_than_tokenizer(llama_dir: Path) -> None:
    config = AutoConfig.from_pretrained(llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    assert config.vocab_size > len(tokenizer)
    assert config.vocab_size % 64 == 0


def test_bfloat16_checkpoint_stores_bfloat16(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(build_checkpoint(tmp_path / "bf16", dtype="bfloat16"))
    assert model.dtype == torch.bfloat16


def test_existing_build_is_reused_and_a_different_one_refused(tmp_path: Path) -> None:
    path = build_checkpoint(tmp_path / "m")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert build_checkpoint(tmp_path / "m") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(FileExistsError):
        build_checkpoint(tmp_path / "m", seed=1)
    build_checkpoint(tmp_path / "m", seed=1, overwrite=True)
    assert (path / "model.safetensors").stat().st_mtime_ns != mtime


def test_unknown_arch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not supported"):
        build_checkpoint(tmp_path / "x", "gpt2")


def test_default_model_dir_honours_cache_env_and_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path))
    path = default_model_dir()
    assert path.parent == tmp_path and "v1" in path.name
    config = AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (256, 688, 4)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp build left beside it
