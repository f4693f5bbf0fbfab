"""Specification of checkpoint loading: what is refused (and how it is explained), and where weights land."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from aioengine.errors import CheckpointError, UnsupportedModelError
from aioengine.model.hf_config import SUPPORTED_ARCHITECTURES, CheckpointConfig, load_hf_config
from aioengine.model.llama import LlamaForCausalLM
from aioengine.model.loader import load_model, resolve_dtype, resolve_max_model_len
from aioengine.testing import build_checkpoint


def load(path: Path, *, strict: bool = True) -> LlamaForCausalLM:
    """The loader's whole path, as the worker runs it on CPU in float32."""
    cfg = load_hf_config(path)
    return load_model(path, cfg, torch.float32, torch.device("cpu"), 64, strict=strict)[0]


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(path: Path, edit: Any) -> None:
    """Applies ``edit`` to the checkpoint's state dict and writes it back as model.safetensors."""
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


# --- refused checkpoints ----------------------------------------------------------------------


def test_unknown_architecture_is_refused_listing_supported_ones(llama_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(llama_ckpt, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))

    with pytest.raises(UnsupportedModelError) as info:
        load_hf_config(path)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_pickle_only_checkpoint_is_refused_and_never_unpickled(llama_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(llama_ckpt, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"

    class Tripwire:  # unpickling this creates `marker`: proof that the file was loaded
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.mkdir, (str(marker),))

    (path / "pytorch_model.bin").write_bytes(pickle.dumps(Tripwire()))

    with pytest.raises(CheckpointError) as info:
        load(path)
    message = str(info.value)
    assert "pytorch_model.bin" in message
    assert "pickle" in message and "never loaded" in message
    assert not marker.exists()


def test_directory_without_config_json_is_refused(llama_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(llama_ckpt, tmp_path / "ckpt")
    (path / "config.json").unlink()

    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_hf_config(path)


def test_missing_tensor_is_an_error_naming_it(llama_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(llama_ckpt, tmp_path / "ckpt")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))

    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load(path)


def test_missing_part_of_a_fused_projection_is_an_error(llama_ckpt: Path, tmp_path: Path) -> None:
    # q_proj and v_proj alone must not pass for a complete qkv_proj.
    path = copy_ckpt(llama_ckpt, tmp_path / "ckpt")
    rewrite_weights(path, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))

    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\."):
        load(path)


def test_unknown_tensor_is_an_error_when_strict(llama_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(llama_ckpt, tmp_path / "ckpt")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.self_attn.bogus.weight": torch.zeros(4, 4)}))

    with pytest.raises(CheckpointError) as info:
        load(path)
    assert "model.layers.0.self_attn.bogus.weight" in str(info.value)
    assert "load.strict" in str(info.value)


def test_unknown_tensor_is_skipped_when_not_strict(llama_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(llama_ckpt, tmp_path / "ckpt")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.self_attn.bogus.weight": torch.zeros(4, 4)}))

    model = load(path, strict=False)
    reference = load(llama_ckpt)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(got, want), name


async def test_engine_config_load_strict_false_serves_checkpoint_with_unknown_tensor(
    llama_ckpt: Path, tmp_path: Path, make_engine: Any
) -> None:
    path = copy_ckpt(llama_ckpt, tmp_path / "ckpt")
    rewrite_weights(path, lambda t: t.update({"extra_head.weight": torch.zeros(4, 4)}))

    async with make_engine(path, cache={"num_blocks": 8}, load={"strict": False}) as engine:
        outputs = [out async for out in engine.generate([5, 6, 7], {"temperature": 0, "max_tokens": 2})]
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 2


def test_wrong_shape_is_an_error_naming_tensor_and_shapes(llama_ckpt: Path, tmp_path: Path) -> None:
    path = copy_ckpt(llama_ckpt, tmp_path / "ckpt")
    name = "model.layers.0.mlp.down_proj.weight"
    rewrite_weights(path, lambda t: t.update({name: torch.zeros(64, 100)}))

    with pytest.raises(CheckpointError) as info:
        load(path)
    message = str(info.value)
    assert name in message
    assert "(64, 100)" in message and "(64, 128)" in message


# --- dtype ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama-bf16", "llama", num_layers=1, dtype="bfloat16")


def test_auto_dtype_is_float32_on_cpu_even_for_a_bf16_checkpoint(bf16_ckpt: Path) -> None:
    assert resolve_dtype("auto", load_hf_config(bf16_ckpt), torch.device("cpu")) == torch.float32


@pytest.mark.parametrize(("ckpt", "expected"), [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_auto_dtype_is_the_checkpoint_dtype_on_cuda(
    ckpt: str, expected: torch.dtype, bf16_ckpt: Path, llama_ckpt: Path
) -> None:
    cfg = load_hf_config(bf16_ckpt if ckpt == "bf16" else llama_ckpt)
    assert resolve_dtype("auto", cfg, torch.device("cuda")) == expected


def test_explicit_dtype_overrides_the_checkpoint(llama_ckpt: Path) -> None:
    assert resolve_dtype("bfloat16", load_hf_config(llama_ckpt), torch.device("cpu")) == torch.bfloat16


# --- where weights land -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_qkv_and_gate_up_hold_hf_projections_in_order(arch: str, llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    path = llama_ckpt if arch == "llama" else qwen2_ckpt
    ours, theirs = load(path), hf_model(path)
    for mine, hf in zip(ours.model.layers, theirs.model.layers, strict=True):
        q, k, v = hf.self_attn.q_proj, hf.self_attn.k_proj, hf.self_attn.v_proj
        qkv = mine.self_attn.qkv_proj
        nq, nk = q.weight.shape[0], k.weight.shape[0]
        assert torch.equal(qkv.weight[:nq], q.weight)
        assert torch.equal(qkv.weight[nq : nq + nk], k.weight)
        assert torch.equal(qkv.weight[nq + nk :], v.weight)
        assert qkv.weight.shape[0] == nq + 2 * nk
        if arch == "qwen2":  # q/k/v carry biases, fused the same way
            assert torch.equal(qkv.bias, torch.cat([q.bias, k.bias, v.bias]))
        inter = hf.mlp.gate_proj.weight.shape[0]
        assert torch.equal(mine.mlp.gate_up_proj.weight[:inter], hf.mlp.gate_proj.weight)
        assert torch.equal(mine.mlp.gate_up_proj.weight[inter:], hf.mlp.up_proj.weight)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_unfused_parameters_equal_hf(arch: str, llama_ckpt: Path, qwen2_ckpt: Path) -> None:
    path = llama_ckpt if arch == "llama" else qwen2_ckpt
    ours = dict(load(path).named_parameters(remove_duplicate=False))
    theirs = dict(hf_model(path).named_parameters(remove_duplicate=False))
    fused = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    plain = [n for n in theirs if not any(f".{f}." in n for f in fused)]
    assert "lm_head.weight" in plain and "model.norm.weight" in plain
    for name in plain:
        assert name in ours, name
        assert torch.equal(ours[name], theirs[name]), name


def test_qwen2_tied_embeddings_share_storage(qwen2_ckpt: Path) -> None:
    model = load(qwen2_ckpt)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert head is embed or head.data_ptr() == embed.data_ptr()
    assert head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
    stored = load_file(str(qwen2_ckpt / "model.safetensors"))
    assert "lm_head.weight" not in stored  # the checkpoint really is tied: only the embedding is stored
    assert torch.equal(head, stored["model.embed_tokens.weight"])


# --- max_model_len -----------------------------------------------------------------------------
# Sliding-window attention is not implemented: within the window it equals full attention, so a
# model that slides is served up to its window, never beyond.
def config_json(tmp_path: Path, model_type: str, **fields: Any) -> CheckpointConfig:
    """``config.json`` with ``fields`` (the rest left to the class defaults), read as the engine reads it."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type, **fields}))
    return load_hf_config(tmp_path)


def test_a_sliding_window_smaller_than_the_positions_caps_max_model_len_to_the_window(tmp_path: Path) -> None:
    config = config_json(tmp_path, "qwen2", max_position_embeddings=4096, sliding_window=1024, use_sliding_window=True)
    assert resolve_max_model_len(config, None) == 1024
    assert resolve_max_model_len(config, 2048) == 1024  # a requested length beyond the window too
    assert resolve_max_model_len(config, 512) == 512  # within the window: as requested


def test_a_sliding_window_caps_max_model_len_in_a_config_without_use_sliding_window(tmp_path: Path) -> None:
    # Mistral configs have sliding_window only: it is on
    assert (
        resolve_max_model_len(config_json(tmp_path, "mistral", max_position_embeddings=4096, sliding_window=256), None)
        == 256
    )


def test_a_sliding_window_that_is_switched_off_does_not_cap_max_model_len(tmp_path: Path) -> None:
    config = config_json(tmp_path, "qwen2", max_position_embeddings=4096, sliding_window=1024, use_sliding_window=False)
    assert resolve_max_model_len(config, None) == 4096
    assert resolve_max_model_len(config_json(tmp_path, "llama", max_position_embeddings=4096), None) == 4096
    config = config_json(tmp_path, "mistral", max_position_embeddings=4096, sliding_window=None)
    assert resolve_max_model_len(config, None) == 4096
