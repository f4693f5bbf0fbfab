"""Loading an HF checkpoint directory: config, dtype, and safetensors weights tensor by tensor."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from aioengine.errors import CheckpointError, UnsupportedModelError
from aioengine.model.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, build_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_hf_config(path: str | Path) -> Any:
    """Reads ``config.json`` with transformers and refuses architectures we do not implement."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not an HF checkpoint directory: config.json is missing")
    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    archs = getattr(cfg, "architectures", None) or []
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {archs[0] if archs else None!r} in {path / 'config.json'} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return cfg


def resolve_dtype(dtype: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (much faster there than bf16) and the checkpoint's dtype elsewhere."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt)
    return ckpt if ckpt in _DTYPES.values() else torch.float32


def resolve_max_model_len(hf_config: Any, requested: int | None) -> int:
    """The longest sequence (prompt + output) the engine will accept."""
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 2048)
    if requested is not None and requested > limit:
        raise CheckpointError(
            f"model.max_model_len={requested} exceeds the checkpoint's max_position_embeddings={limit}"
        )
    length = requested or limit
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and length > window:
        # Within the window full attention equals sliding attention, so capping keeps outputs exact.
        logger.warning("sliding-window attention is not implemented; max_model_len capped to %d", window)
        length = int(window)
    return length


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when sharded. Pickle files are refused."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {pickles}: pickle weights are never loaded, convert them to safetensors)" if pickles else ""
        raise CheckpointError(f"no *.safetensors files in {path}{hint}")
    return files


def iter_safetensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` one tensor at a time, so peak extra memory is one tensor."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, ValueError, RuntimeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"cannot read {file}: {exc}") from exc


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True,
                 partial: bool = False) -> int:
    """Copies checkpoint tensors into ``model`` in place; returns the number of tensors written.

    Every parameter must be covered unless ``partial`` (an update of some weights of a loaded
    model); with ``strict`` an unknown checkpoint name is an error too.
    """
    params = dict(model.named_parameters())
    filled: dict[str, set[tuple[int, int]]] = {name: set() for name in params}  # (offset, rows) pieces written
    written = 0
    for name, tensor in weights:
        try:
            target = model.resolve_weight(name)
        except KeyError:
            if strict:
                raise CheckpointError(
                    f"checkpoint tensor {name!r} has no place in {type(model).__name__} "
                    "(set load.strict=false to skip unknown tensors)"
                ) from None
            continue
        if target is None:
            continue
        param = params[target.param]
        dst = param.data if target.size is None else param.data.narrow(0, target.offset, target.size)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
        filled[target.param].add((target.offset, dst.shape[0] if dst.dim() else 1))
        written += 1
    if partial:
        return written
    # A set of pieces, not a running count: a tensor repeated in two shards cannot hide a missing one.
    missing = [n for n, pieces in filled.items() if sum(rows for _, rows in pieces) < max(params[n].shape[0:1] or (1,))]
    if missing:
        raise CheckpointError(f"checkpoint is missing tensors for: {', '.join(_hf_names(n) for n in missing[:8])}")
    return written


def _hf_names(param: str) -> str:
    """Our parameter name, with the checkpoint names it is fused from."""
    for fused, parts in (("qkv_proj", "q_proj/k_proj/v_proj"), ("gate_up_proj", "gate_proj/up_proj")):
        if f".{fused}." in param:
            return f"{param} (from {param.replace(fused, '{' + parts + '}')})"
    return param


def load_model(path: str | Path, hf_config: Any, dtype: torch.dtype, device: torch.device, max_positions: int,
               *, strict: bool = True) -> LlamaForCausalLM:
    """Builds the model without initialising it (meta device), then fills it from the checkpoint."""
    with torch.device("meta"):
        model = build_model(hf_config, max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    if model.tie_word_embeddings:  # to_empty may hand the tied pair separate storages
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.reset_buffers(device)
    load_weights(model, iter_safetensors(checkpoint_files(path)), strict=strict)
    return model.eval().requires_grad_(False)
