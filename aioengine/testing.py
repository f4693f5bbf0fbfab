"""Small random-init Hugging Face checkpoints, built locally from a fixed seed.

Tests, benchmarks and the demo need real models but cannot download any, so this module trains a tiny
byte-level BPE tokenizer on a built-in corpus and saves a randomly initialised ``*ForCausalLM`` with
``save_pretrained``: the output is genuine HF format (config, generation config, safetensors, index when
sharded, tokenizer files) that both the engine and ``transformers`` load.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

__all__ = ["SUPPORTED_TEST_ARCHS", "build_checkpoint", "build_tokenizer", "default_model_dir"]

SUPPORTED_TEST_ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# Callable[..., ...]: the config classes take fields their signatures do not list (e.g. Qwen2Config's head_dim).
_CONFIGS: dict[str, tuple[Callable[..., PretrainedConfig], str]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "mistral": (MistralConfig, "MistralForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
}

# NOTE: initializer_range. HF's default std of 0.02 gives a tiny random model nearly flat logits (std 0.16
# at hidden 64): little variety, and qwen2 (tied embeddings) just repeats one token. A Linear's gain is
# std * sqrt(fan_in), so the default is _LOGIT_STD / sqrt(hidden_size): logits of std 1.6 at any width
# (0.2 at hidden 64, 0.1 for the demo's 256). Measured with HF greedy generate in float32, 16 random
# prompts x 32 steps, default shapes, llama/qwen2/qwen3 seeds 0-4 (mistral is llama's math exactly):
#   - top1-top2 logit gap: median 0.29-0.37, 1st percentile 3.6e-3..1.3e-2, minimum 1.9e-4..6.5e-3
#     (median of the 15 minima 1.4e-3). Demo shape, seeds 0-2: minimum 2e-4..1.1e-3, 1st pct 6e-3..8e-3.
#   - each prompt alone == all 16 in one left-padded batch (with attention mask): 16/16 in every run;
#     the two runs' logits differ by 8e-6..3e-5, about 2e4x below the median gap.
#   - variety: 15-32 distinct tokens per 32-step continuation (median 28-31); changing only the first
#     prompt token changes 16/16 continuations, so KV-cache or position bugs show in the tokens.
# The minimum gap is a tail statistic (~ median gap / number of steps) that a larger std cannot fix: the
# noise grows faster than the gap (std 0.8: 3e-6, 1.6: 1.5e-5, 4.8: 3e-4), while a smaller std loses variety.
_LOGIT_STD = 1.6

_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
# Written last: its presence means the directory is complete; its content says how it was built.
_MARKER = "aioengine_checkpoint.json"
# Bump the version whenever the demo's build changes (shape, corpus, _LOGIT_STD): old caches are reused as is.
_DEMO_NAME = "demo-llama-v1"
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# A few KB of plain text, plus non-ASCII lines so the merges cover multi-byte UTF-8 too.
_CORPUS = """\
The engine reads a prompt, turns it into tokens, and hands the tokens to a model that predicts the next one.
Each step of decoding appends a single token to every running request, so many requests share one forward pass.
A scheduler decides which requests run, which wait, and which are preempted when the cache is full.
The key and value cache holds what attention has already computed, split into blocks of a fixed size.
When a request finishes, its blocks return to the free list and another request may take them at once.
Streaming output lets a caller see text as soon as it is produced instead of waiting for the whole answer.
Sampling turns logits into a choice: greedy takes the largest, while temperature, top-k and top-p add variety.
A small model is useful for tests because it loads quickly and gives the same answer every time it runs.
Once upon a time there was a little fox who lived at the edge of a quiet forest near a river.
Every morning the fox walked down to the water, watched the fish, and listened to the birds in the trees.
One day a heavy storm came over the hills, and the river rose higher than anyone could remember.
The fox helped a rabbit, a mouse and an old turtle climb onto a fallen log, and together they floated to safety.
When the sun came back, the animals thanked the fox and promised to help each other whenever trouble came.
Python is a programming language that lets you work quickly and integrate systems more effectively.
def add(a, b):
    return a + b
for i in range(10):
    print(i, i * i, "square")
import asyncio
async def main() -> None:
    await asyncio.sleep(0.1)
{"name": "example", "values": [1, 2, 3], "ok": true, "ratio": 0.75}
The weather today is cloudy with a chance of rain in the afternoon and a light wind from the west.
Tomorrow will be warmer, with clear skies in the morning and temperatures near twenty degrees.
She opened the window, looked at the garden, and decided that it was a good day to plant tomatoes.
He asked whether the train would leave on time, and the conductor said it was already ten minutes late.
Questions, answers, numbers like 42, 3.14159, 1000000, and dates like 2024-05-17 appear in ordinary text.
Good software is simple to read, easy to test, and honest about what it does when something goes wrong.
An error message should say what was wrong and what the user can do about it.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
How vexingly quick daft zebras jump; the five boxing wizards jump quickly.
Music, art, science, history and mathematics are all ways of understanding the world around us.
The library was open late on Thursdays, so students came to study, read newspapers and borrow books.
A recipe for bread: mix flour, water, salt and yeast; knead the dough; let it rise; then bake it until golden.
Distance is speed multiplied by time, and energy is conserved in a closed system.
Our team meets every Monday to plan the week, review open issues and decide what to ship next.
Please remember to save your work often, and keep a backup of anything you cannot afford to lose.
naïve café, résumé, façade, jalapeño, über, smörgåsbord, crème brûlée, São Paulo, Zürich, Ångström.
Ça va très bien, merci. ¿Dónde está la estación? Größe, Straße, Mädchen, før, żółw, čaj.
Привет, как дела? Спасибо, всё хорошо. Γειά σου κόσμε. שלום עולם. مرحبا بالعالم.
日本語のテキストと漢字、ひらがな、カタカナ。東京は日本の首都です。
中文文本：你好，世界！今天天气很好。我们一起学习。
한국어 텍스트: 안녕하세요, 세계! 감사합니다.
emoji 🤖🚀🎉👍😀❤️🔥✨🌍🐍 and symbols → ← ✓ © ® ™ € £ ¥ ° ± × ÷ ∞ ≈ ≠ ≤ ≥ …
"""  # noqa: RUF001 - deliberately multilingual: Greek letters, fullwidth CJK punctuation and symbols


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    # Training takes a few ms but runs for every checkpoint a test suite builds; cache the result as JSON
    # so every caller still gets a fresh, independent tokenizer object.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        # The full 256-byte alphabet is what makes ANY UTF-8 text encodable, not just the corpus' bytes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    bos = _SPECIAL_TOKENS[0]
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
            ),
        ]
    )
    return tok.to_str()


def build_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Return a deterministic byte-level BPE tokenizer trained on the module's built-in corpus.

    Any UTF-8 text round-trips through ``encode``/``decode``. Encoding prepends ``<|bos|>``; ``<|eos|>``
    and ``<|pad|>`` are the other special tokens. ``vocab_size`` is an upper bound: the corpus allows
    about 1,500 tokens at most.
    """
    bos, eos, pad = _SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        clean_up_tokenization_spaces=False,
        chat_template=_CHAT_TEMPLATE,
    )


def _max_shard_size(model: torch.nn.Module, num_shards: int) -> int:
    # Smallest shard limit that HF's own splitter turns into at most num_shards files (the count only
    # falls as the limit grows), so asking for N shards gives N files whenever the tensors allow it.
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())  # lists a tied weight once
    lo = 1
    hi = sum(t.numel() * t.element_size() for t in tensors.values())
    while lo < hi:
        mid = (lo + hi) // 2
        if len(split_torch_state_dict_into_shards(tensors, max_shard_size=mid).filename_to_tensors) <= num_shards:
            hi = mid
        else:
            lo = mid + 1
    return hi


def _is_complete(path: Path, build_args: dict[str, object] | None = None) -> bool:
    try:
        recorded = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):  # missing, or cut short by a crash while it was written
        return False
    return build_args is None or recorded == build_args


def build_checkpoint(
    path: str | os.PathLike[str],
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    num_shards: int = 1,
    dtype: str = "float32",
    initializer_range: float | None = None,
    tokenizer_vocab_size: int = 1024,
    overwrite: bool = False,
) -> Path:
    """Write a random-init HF checkpoint of ``arch`` (one of ``SUPPORTED_TEST_ARCHS``) into ``path``.

    The directory gets ``config.json``, ``generation_config.json``, ``model.safetensors`` (or
    ``num_shards`` shards plus ``model.safetensors.index.json``) and the tokenizer files. The same
    arguments give byte-identical weights. ``vocab_size`` defaults to the tokenizer's length rounded up
    to a multiple of 64, plus 64, so the model can emit ids the tokenizer cannot decode. ``None`` for
    ``tie_word_embeddings`` means only qwen2 ties; for ``initializer_range`` it means
    ``1.6 / sqrt(hidden_size)``, which keeps greedy decoding robust to float noise (see the module notes).
    A directory already holding a checkpoint built with the same arguments is reused unless
    ``overwrite``; any other non-empty directory raises ``FileExistsError`` unless ``overwrite``.
    """
    if arch not in _CONFIGS:
        raise ValueError(f"arch {arch!r} is not supported; use one of {SUPPORTED_TEST_ARCHS}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a torch floating dtype; use e.g. 'float32' or 'bfloat16'")
    if initializer_range is None:
        initializer_range = round(_LOGIT_STD / math.sqrt(hidden_size), 6)
    path = Path(path)
    # Every argument that shapes the output (all parameters so far, defaults resolved): the reuse key.
    build_args = {k: v for k, v in locals().items() if k not in ("path", "overwrite", "torch_dtype")}
    if path.exists() and any(path.iterdir()):
        if not overwrite and _is_complete(path, build_args):
            return path
        if not overwrite:
            raise FileExistsError(f"{path} is not empty and was not built with these arguments; pass overwrite=True")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(tokenizer_vocab_size)
    tokenizer.model_max_length = max_position_embeddings
    if vocab_size is None:
        vocab_size = math.ceil(len(tokenizer) / 64) * 64 + 64
    if head_dim is None:
        head_dim = hidden_size // num_heads  # explicit: Qwen3Config would default to 128, Qwen2's to None
    config_cls, architecture = _CONFIGS[arch]
    # Mistral without a sliding window behaves like HF's at any length; real Qwen3 has no q/k/v bias.
    extras: dict[str, dict[str, Any]] = {"mistral": {"sliding_window": None}, "qwen3": {"attention_bias": False}}
    extra = extras.get(arch, {})
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=(arch == "qwen2") if tie_word_embeddings is None else tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[architecture],
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if torch_dtype != torch.float32:
        # Initialise in float32 then cast, so a bf16 checkpoint holds the rounded float32 weights.
        model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    shard_size = "50GB" if num_shards == 1 else _max_shard_size(model, num_shards)
    model.save_pretrained(path, max_shard_size=shard_size)
    tokenizer.save_pretrained(path)
    if list(path.glob("*.bin")) or not list(path.glob("*.safetensors")):
        raise RuntimeError(f"save_pretrained wrote no safetensors (or also .bin files) into {path}")
    (path / _MARKER).write_text(json.dumps(build_args, indent=2) + "\n")
    return path


def _cache_root() -> Path:
    if env := os.environ.get("AIOENGINE_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "aioengine"


def default_model_dir() -> Path:
    """Return the random-init demo model (Llama, hidden 256, 4 layers, seed 0), building it on first use.

    The engine's default model is the real SmolLM2-135M-Instruct of ``aioengine.models``; this one is its
    fallback when that cannot be fetched, and what ``AIOENGINE_DEFAULT_MODEL=random`` picks (quick, but
    its text is gibberish). It lives under ``$AIOENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/aioengine``,
    else ``~/.cache/aioengine``. The build goes to a temp dir beside it and is renamed into place, so a
    crash or a concurrent process never leaves a half-written model behind.
    """
    final = _cache_root() / _DEMO_NAME
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_DEMO_NAME}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would hide a shared cache from other users
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a build of a second or so: no "Writing model shards" bar
    try:
        build_checkpoint(
            tmp, "llama", hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, num_kv_heads=2, seed=0
        )
        if final.exists() and not _is_complete(final):
            # Only a foreign or hand-damaged dir can be incomplete: ours always appear whole via rename.
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process renamed its (identical) build into place first.
            if not _is_complete(final):
                raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)
    return final
