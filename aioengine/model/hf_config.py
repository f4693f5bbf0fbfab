"""``config.json`` of an HF checkpoint, read without transformers.

Importing transformers' config classes costs about 3.5 s (they pull in its modeling machinery and
``torch.distributed.tensor``), most of the engine's start-up beside torch itself, to read a few
numbers from a JSON file. ``load_hf_config`` reads them directly, with the defaults of
transformers' config class for the checkpoint's ``model_type`` (``LlamaConfig``, ``MistralConfig``,
``Qwen2Config``, ``Qwen3Config``) and the same derived values (``head_dim``, ``num_key_value_heads``,
``rope_parameters``, Qwen's ``use_sliding_window``). ``tests/test_hf_config.py`` holds it equal to
``AutoConfig`` on every supported architecture and on configs that leave the defaults to the class.

Rope types other than the plain one are computed by transformers' own ``ROPE_INIT_FUNCTIONS``, which
take transformers' config object: ``transformers_config()`` loads it then, and only then.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aioengine.errors import CheckpointError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# The defaults of transformers' config class for each model_type (transformers 5.x), for the keys read here.
_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "head_dim": None,
    "rope_theta": 10000.0,
    "sliding_window": None,
    "use_sliding_window": True,  # Mistral has no switch: its window is on whenever set
    "eos_token_id": None,
}
_QWEN2: dict[str, Any] = _COMMON | {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "use_sliding_window": False,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _COMMON
    | {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "max_position_embeddings": 2048,
        "eos_token_id": 2,
    },
    "mistral": _COMMON
    | {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
        "eos_token_id": 2,
    },
    "qwen2": _QWEN2,
    "qwen3": _QWEN2 | {"head_dim": 128},
}
_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class CheckpointConfig:
    """What the engine reads of a checkpoint's ``config.json``, defaults and derived values resolved.

    Attribute names are transformers' own, so model code reads this and a transformers config alike
    (tests build models from ``LlamaConfig`` objects directly)."""

    path: Path
    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_parameters: Mapping[str, Any]
    """``rope_type``, ``rope_theta`` and the type's own keys (transformers 5's form; 4.x's ``rope_scaling``
    and ``rope_theta`` are folded in)."""
    sliding_window: int | None
    """The attention window, None without one (Qwen's ``use_sliding_window: false`` included)."""
    dtype: str | None
    eos_token_id: int | list[int] | None
    raw: Mapping[str, Any] = field(repr=False)
    """The whole ``config.json``."""

    def transformers_config(self) -> Any:
        """transformers' own config object for this checkpoint (imports transformers: seconds, once)."""
        return _transformers_config(str(self.path))


@functools.cache
def _transformers_config(path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def load_hf_config(path: str | Path) -> CheckpointConfig:
    """Reads ``config.json``; refuses architectures we do not implement and values of the wrong kind."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path} is not an HF checkpoint directory: config.json is missing")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} holds {type(raw).__name__}, not a JSON object")
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} in {file} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    model_type = raw.get("model_type")
    if model_type not in _DEFAULTS:
        raise UnsupportedModelError(
            f"model_type {model_type!r} in {file} is not supported; supported: {', '.join(_DEFAULTS)}"
        )
    values = _DEFAULTS[model_type] | {k: v for k, v in raw.items() if k in _DEFAULTS[model_type]}
    for key in _INTS:
        value = values[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise CheckpointError(f"{file}: {key} must be a positive integer, got {value!r}")
    heads = values["num_attention_heads"]
    window = values["sliding_window"] if values["use_sliding_window"] else None
    return CheckpointConfig(
        path=path,
        model_type=model_type,
        architectures=tuple(archs),
        vocab_size=values["vocab_size"],
        hidden_size=values["hidden_size"],
        intermediate_size=values["intermediate_size"],
        num_hidden_layers=values["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=values["num_key_value_heads"] or heads,
        head_dim=values["head_dim"] or values["hidden_size"] // heads,
        hidden_act=str(values["hidden_act"]),
        rms_norm_eps=_number(file, "rms_norm_eps", values["rms_norm_eps"]),
        max_position_embeddings=values["max_position_embeddings"],
        tie_word_embeddings=bool(values["tie_word_embeddings"]),
        attention_bias=bool(values["attention_bias"]),
        rope_parameters=_rope_parameters(file, raw, values["rope_theta"]),
        sliding_window=window,
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
        eos_token_id=values["eos_token_id"],
        raw=raw,
    )


def _number(file: Path, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckpointError(f"{file}: {key} must be a number, got {value!r}")
    return float(value)


def _rope_parameters(file: Path, raw: Mapping[str, Any], default_theta: float) -> dict[str, Any]:
    """transformers 5's standardisation: ``rope_scaling`` (4.x) or ``rope_parameters``, with ``rope_theta`` and
    ``partial_rotary_factor`` from the top level where the dict lacks them, ``type`` read as ``rope_type``."""
    given = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(given, dict):
        raise CheckpointError(f"{file}: rope parameters must be a JSON object, got {given!r}")
    params = dict(given)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", raw.get("rope_theta", default_theta))
    if "partial_rotary_factor" in raw:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    params["rope_theta"] = _number(file, "rope_theta", params["rope_theta"])
    return params
