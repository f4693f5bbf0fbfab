"""How a Llama-family model splits over tensor-parallel ranks: plain arithmetic, no torch.

The layers (``aioengine.model.llama``) take their shapes from here, and the executor checks a split here
before it starts any rank, so a model that cannot be split is refused in the engine process at once,
naming the counts, instead of after N processes have started.
"""

from __future__ import annotations

import json
from pathlib import Path

from aioengine.errors import UnsupportedModelError


def partition(total: int, size: int, what: str) -> int:
    """``total / size``; UnsupportedModelError naming ``what`` when it does not divide."""
    if total % size:
        raise UnsupportedModelError(
            f"{what}={total} cannot be split over tensor_parallel_size={size}: it must divide evenly"
        )
    return total // size


def split_heads(heads: int, kv_heads: int, size: int, rank: int = 0) -> tuple[int, int, int]:
    """Rank ``rank``'s query heads, KV heads, and the first KV head it holds. Query heads split evenly; KV heads
    too when there are at least ``size`` of them, else each is replicated on ``size / kv_heads`` ranks."""
    if heads % size or (kv_heads % size if kv_heads >= size else size % kv_heads):
        raise UnsupportedModelError(
            f"the model has {heads} attention heads and {kv_heads} KV heads, which cannot be split over "
            f"tensor_parallel_size={size}: it must divide the attention heads, and divide the KV heads or be "
            "a multiple of them"
        )
    if kv_heads >= size:
        local_kv = kv_heads // size
        return heads // size, local_kv, rank * local_kv
    return heads // size, 1, rank * kv_heads // size


def check_checkpoint_split(path: str | Path, size: int) -> None:
    """Raises UnsupportedModelError unless the checkpoint at ``path`` splits over ``size`` ranks (heads, KV
    heads, intermediate size, vocabulary). A directory without a readable config.json is left to the loader,
    which names what is wrong with it."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        sizes = {"intermediate_size": int(cfg["intermediate_size"]), "vocab_size": int(cfg["vocab_size"])}
    except (OSError, ValueError, KeyError, TypeError):
        return
    split_heads(heads, kv_heads, size)
    for what, total in sizes.items():
        partition(total, size, what)
