"""A GGUF model (Llama family) written out as a plain float32 HF checkpoint, and the check of one.

``convert_gguf`` dequantizes the GGUF with transformers' GGUF loader (needs the ``gguf`` and
``accelerate`` packages) and writes config, generation config, ``model.safetensors``, tokenizer and chat
template, then, last, ``aioengine_model.json``: the sha256 and size of every file it wrote.
``verify_model_dir`` checks a converted checkpoint against that record. Where the GGUF comes from and
where the checkpoint lives (the embedded default model, the user cache) is ``aioengine.models``'s part.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "CONVERSION_VERSION",
    "MARKER",
    "ModelConversionError",
    "convert_gguf",
    "file_sha256",
    "verify_model_dir",
]

MARKER = "aioengine_model.json"
"""Written last into a converted checkpoint: where it came from and the hash of every file."""
CONVERSION_VERSION = 1
"""Bump when the conversion's output changes: older conversions are then converted again."""


class ModelConversionError(RuntimeError):
    """A wheel or GGUF file could not be converted (a package missing, an unexpected file)."""


# ---- hashing and verification --------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    """The sha256 of the file at ``path``, as hex (read in 4 MiB chunks)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):  # missing, or cut short by a crash while it was written
        return None
    return marker if isinstance(marker, dict) else None


def verify_model_dir(path: str | os.PathLike[str]) -> str | None:
    """Checks a converted checkpoint against the sizes and sha256 its conversion recorded.

    Returns None when every recorded file is intact, else what is wrong (one line).
    """
    path = Path(path)
    marker = _read_marker(path)
    if marker is None:
        return f"{path} has no readable {MARKER} (not converted, or cut short)"
    if marker.get("conversion_version") != CONVERSION_VERSION:
        return f"{path} was converted by another aioengine version (conversion {marker.get('conversion_version')})"
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return f"{path}/{MARKER} lists no files"
    for name, record in files.items():
        file = path / name
        try:
            size = file.stat().st_size
        except OSError:
            return f"{file} is missing"
        if size != record.get("size"):
            return f"{file} has {size} bytes, {record.get('size')} were written"
        if file_sha256(file) != record.get("sha256"):
            return f"{file} does not match the sha256 recorded at conversion"
    return None


# ---- conversion ----------------------------------------------------------------------------------------


def _require_conversion_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelConversionError(
            f"converting a GGUF model needs the {' and '.join(repr(m) for m in missing)} package"
            f"{'s' if len(missing) > 1 else ''}: python3 -m pip install {' '.join(missing)} "
            "(or reinstall aioengine: python3 -m pip install -e .)"
        )


def convert_gguf(gguf_file: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Writes a GGUF model (Llama family) as a plain float32 HF checkpoint into ``out_dir`` (created).

    Writes config.json (``architectures`` set, no ``quantization_config``), generation_config.json,
    model.safetensors (the tied lm_head left out, as HF does), the tokenizer with its chat template, and
    last ``aioengine_model.json`` with every file's sha256. The EOS of both configs is the tokenizer's EOS
    (``<|im_end|>`` for SmolLM2), which is what the engine stops on.
    """
    _require_conversion_packages()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, local_files_only=True)
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        k: v.detach().to(torch.float32).contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")  # one storage in the model; safetensors refuses shared tensors
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state

    # save_pretrained refuses a GGUF-quantized model, so the config goes out by itself, made plain.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.__dict__.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    eos = tokenizer.eos_token_id
    if eos is not None:
        config.eos_token_id = eos
    if getattr(config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(out)
    generation = model.generation_config
    if eos is not None:
        generation.eos_token_id = eos
    generation.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)  # with the chat template, when the GGUF has one
    _tidy_tokenizer_config(out / "tokenizer_config.json")
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0o600, which would hide a shared cache from other users

    files = {
        f.name: {"sha256": file_sha256(f), "size": f.stat().st_size}
        for f in sorted(out.iterdir())
        if f.is_file() and f.name != MARKER
    }
    marker = {
        "conversion_version": CONVERSION_VERSION,
        "source_gguf": gguf_file.name,
        "gguf_sha256": file_sha256(gguf_file),
        "architecture": config.architectures[0],
        "files": files,
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def _tidy_tokenizer_config(path: Path) -> None:
    """Drops the loading options transformers writes back (``local_files_only``...) and names the tokenizer
    class that every transformers release knows (transformers 5 writes its alias ``TokenizersBackend``)."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    for key in ("is_local", "local_files_only", "gguf_file"):
        config.pop(key, None)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
