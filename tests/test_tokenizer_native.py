"""Specification of aioengine's own tokenizer (``aioengine.engine.tokenizer``): on the same files it gives what
transformers' ``AutoTokenizer`` gives, for everything the engine uses.

Every parity test runs on the test checkpoints, ``build_tokenizer``'s tokenizer, the real model (when it can be
had) and synthetic variants of ``build_tokenizer``'s files, each written to exercise one rule of transformers.
Where the native tokenizer is chosen, and where it must not be, is in test_tokenizer_loading.py, which uses the
directories and fixtures defined here.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from aioengine.engine import tokenizer as tokenization
from aioengine.engine.intake import apply_chat_template
from aioengine.engine.tokenizer import NativeTokenizer, TokenizerFiles, unsupported_reason
from aioengine.testing import SUPPORTED_TEST_ARCHS, build_checkpoint, build_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, résumé, façade, Zürich, Ångström; Größe, żółw, čaj",
    "中文文本：你好，世界！日本語のテキスト。한국어 텍스트",  # noqa: RUF001 - fullwidth punctuation on purpose
    "emoji 🤖🚀🎉👍😀❤️🔥✨ and symbols → ← ✓ © € ∞ ≈",
    "  leading,   runs  of   spaces,\t\ttabs  ",
    "line one\nline two\r\n\n\n  indented\n",
    "don't , stop . now ! ok ? isn't it 's 're 've 'm",
    "def add(a, b):\n    return a + b\n",
    "",
    " ",
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "user", "content": "Hi, I am Ada. 🤖"},
        {"role": "assistant", "content": " Hello Ada! ", "tool_calls": None},
        {"role": "user", "content": "naïve 中文 question\nover two lines"},
    ],
    [{"role": "user", "content": "think first"}, {"role": "assistant", "content": "ok", "reasoning": "hmm"}],
]

# A template that uses what transformers' sandbox adds: namespace, loop controls, tojson (with options),
# dict, raise_exception, strftime_now, {% generation %}, the special tokens and the aliased reasoning fields.
RICH_TEMPLATE = """{%- set ns = namespace(turns=0, system='') -%}
{%- for m in messages -%}
{%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] -%}{%- continue -%}{%- endif -%}
{%- if m['role'] not in ['user', 'assistant'] -%}{{ raise_exception('unknown role ' + m['role']) }}{%- endif -%}
{%- set ns.turns = ns.turns + 1 -%}
{{ bos_token }}{{ m['role'] }} {{ ns.turns }}: {% if m['role'] == 'assistant' %}{% generation %}
{{- m['content'] | trim }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}
{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}|{{ m.thinking }}</think>{% endif %}
{%- if loop.index > 8 %}{% break %}{% endif %}
{% endfor -%}
{{ {'system': ns.system, 'turns': ns.turns, 'ü': 'ü'} | tojson }}{{ [1, 2] | tojson(indent=2) }}
{{- dict(b=1, a=2) | tojson(sort_keys=True) }}{{ strftime_now('%Y') | length }}{{ pad_token }}
{%- if add_generation_prompt %}assistant: {% endif -%}"""


# ---- the tokenizer directories --------------------------------------------------------------------------------


CONFIG, BACKEND = "tokenizer_config.json", "tokenizer.json"
DROP = object()
"""A value for ``_set``: the key is removed."""


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _set(file: str, **values: Any) -> Callable[[Path], None]:
    """An edit of a tokenizer directory: ``file``'s keys set to ``values`` (``DROP`` removes one)."""

    def edit(data: dict[str, Any]) -> None:
        for key, value in values.items():
            if value is DROP:
                data.pop(key)
            else:
                data[key] = value

    return lambda d: _edit_json(d / file, edit)


def _write(file: str, text: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        (d / file).parent.mkdir(parents=True, exist_ok=True)
        (d / file).write_text(text)

    return edit


def _template_in_config(wrap: Callable[[str], object]) -> Callable[[Path], None]:
    """An edit: chat_template.jinja moved into tokenizer_config.json as ``wrap(template)``."""

    def edit(d: Path) -> None:
        template = (d / "chat_template.jinja").read_text()
        (d / "chat_template.jinja").unlink()
        _set(CONFIG, chat_template=wrap(template))(d)

    return edit


def _edits(*edits: Callable[[Path], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        for one in edits:
            one(d)

    return edit


PLAIN_TOKEN = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
ADDED_TOKENS = {  # tokenizer.json's added tokens as a transformers 4 config lists them, two with other flags
    "0": {"content": "<|bos|>", **PLAIN_TOKEN, "special": True},
    "1": {"content": "<|eos|>", **PLAIN_TOKEN, "lstrip": True, "rstrip": True, "special": True},
    "2": {"content": "<|pad|>", **PLAIN_TOKEN, "normalized": True, "special": False},
}
EOS_POST_PROCESSOR = {
    "type": "TemplateProcessing",
    "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|eos|>", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<|eos|>": {"id": "<|eos|>", "ids": [1], "tokens": ["<|eos|>"]}},
}
TRUNCATION = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
PADDING = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 1,
           "pad_type_id": 0, "pad_token": "<|eos|>"}  # fmt: skip
SPECIAL_TOKENS_MAP = {
    "eos_token": {"content": "<|pad|>", **PLAIN_TOKEN},
    "unk_token": "<unk>",
    "additional_special_tokens": ["<extra>", "<|eos|>"],
}

VARIANTS: dict[str, Callable[[Path], None]] = {
    # chat templates
    "template-in-config": _template_in_config(lambda t: t),
    "template-list": _template_in_config(
        lambda t: [{"name": "tool_use", "template": "T{{ messages | length }}"}, {"name": "default", "template": t}]
    ),
    "template-files": _write("additional_chat_templates/short.jinja", "{{ messages[0]['content'] }}"),
    "rich-template": _write("chat_template.jinja", RICH_TEMPLATE),
    # the post-processor, and the settings transformers turns off or ignores beside a tokenizer.json
    "no-post-processor": _set(BACKEND, post_processor=None),
    "eos-by-post-processor": _set(BACKEND, post_processor=EOS_POST_PROCESSOR),
    "add-bos-eos-flags": _set(CONFIG, add_bos_token=False, add_eos_token=True),
    "truncation-and-padding": _edits(
        _set(BACKEND, truncation=TRUNCATION, padding=PADDING), _set(CONFIG, pad_token=DROP)
    ),
    "split-special-tokens": _set(CONFIG, split_special_tokens=True),
    # special tokens in their many spellings
    "bos-as-added-token-object": _set(CONFIG, bos_token={"__type": "AddedToken", "content": "<|bos|>", **PLAIN_TOKEN}),
    "added-tokens-decoder": _set(CONFIG, added_tokens_decoder=ADDED_TOKENS),
    "special-tokens-map": _write("special_tokens_map.json", json.dumps(SPECIAL_TOKENS_MAP)),
    "new-special-tokens": _set(
        CONFIG,
        unk_token="<unk>",
        image_token="<image>",
        extra_special_tokens={"audio_token": "<audio>", "video_token": "<|pad|>"},
        clip_token={"__type": "AddedToken", "content": "<clip>", **PLAIN_TOKEN, "special": True},
    ),
    "vocabulary-tokens-as-specials": _set(CONFIG, eos_token="the", pad_token="Ġthe", mask_token="ing"),
    # decoding clean-up (a BPE model skips it unless forced) and the length limit
    "clean-up-bpe": _set(CONFIG, clean_up_tokenization_spaces=True),
    "clean-up-bpe-forced": _set(
        CONFIG,
        clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    ),
    "no-model-max-length": _set(CONFIG, model_max_length=DROP),
    "max-len": _set(CONFIG, model_max_length=DROP, max_len=77),
}


def _wordpiece(path: Path, clean_up: bool) -> Path:
    """A WordPiece tokenizer: its decoding puts spaces before punctuation, which the clean-up takes out."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS * 10, trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    names = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=clean_up, **dict(zip(names, specials, strict=True))
    )
    fast.save_pretrained(path)
    return path


NATIVE_CHECKPOINTS = ("llama", "mistral", "qwen3")
DIRECTORIES = ["build_tokenizer", *(f"checkpoint-{a}" for a in NATIVE_CHECKPOINTS), *VARIANTS,
               "wordpiece-clean-up", "wordpiece-raw", "real-model"]  # fmt: skip


@pytest.fixture(scope="session", name="base_dir")
def base_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "base"
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session", name="checkpoints")
def checkpoints_fixture(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: build_checkpoint(root / arch, arch) for arch in SUPPORTED_TEST_ARCHS}


@pytest.fixture(scope="session", params=DIRECTORIES)
def pair(
    request: pytest.FixtureRequest,
    base_dir: Path,
    checkpoints: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[NativeTokenizer, PreTrainedTokenizerBase]:
    """(native, AutoTokenizer) on one of the directories."""
    name: str = request.param
    if name == "build_tokenizer":
        path = base_dir
    elif name.startswith("checkpoint-"):
        path = checkpoints[name.removeprefix("checkpoint-")]
    elif name.startswith("wordpiece-"):
        path = _wordpiece(tmp_path_factory.mktemp("wordpiece") / name, name == "wordpiece-clean-up")
    elif name == "real-model":
        path = request.getfixturevalue("real_model")
    else:
        path = tmp_path_factory.mktemp("variant") / name
        shutil.copytree(base_dir, path)
        VARIANTS[name](path)
    native = tokenization.load(path)
    assert isinstance(native, NativeTokenizer), unsupported_reason(TokenizerFiles.read(path))
    return native, AutoTokenizer.from_pretrained(path, local_files_only=True)


def corpus(hf: PreTrainedTokenizerBase) -> list[str]:
    """The texts, plus some that spell out this tokenizer's special tokens (and tokens it lacks)."""
    specials = hf.all_special_tokens
    return [*CORPUS, "".join(specials), f"before {' mid '.join(specials)} after", "<unk> <image> <clip> [CLS] x"]


# ---- parity with AutoTokenizer --------------------------------------------------------------------------------


def test_encoding_matches_autotokenizer(pair: tuple[NativeTokenizer, PreTrainedTokenizerBase]) -> None:
    native, hf = pair
    for text in corpus(hf):
        for add_special_tokens in (True, False):
            assert native(text, add_special_tokens=add_special_tokens).input_ids == (
                hf(text, add_special_tokens=add_special_tokens).input_ids
            ), (text, add_special_tokens)
        assert native(text)["input_ids"] == hf(text)["input_ids"]
        assert native.encode(text) == hf.encode(text)
        assert native.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_decoding_matches_autotokenizer(pair: tuple[NativeTokenizer, PreTrainedTokenizerBase]) -> None:
    native, hf = pair
    rng = random.Random(0)
    encoded = [hf(text).input_ids for text in corpus(hf)]
    sampled = [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))] for _ in range(60)]
    for ids in [*encoded, *sampled, [], hf.all_special_ids]:
        for skip in (True, False):
            assert native.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)
    assert native.decode(5) == hf.decode(5)
    assert native.batch_decode(encoded, skip_special_tokens=True) == hf.batch_decode(encoded, skip_special_tokens=True)
    for ids in sampled[:10]:
        tokens = native.convert_ids_to_tokens(ids)
        assert tokens == hf.convert_ids_to_tokens(ids)
        assert native.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert native.convert_ids_to_tokens(3) == hf.convert_ids_to_tokens(3)
    assert native.convert_tokens_to_ids("not-a-token-anywhere") == hf.convert_tokens_to_ids("not-a-token-anywhere")
    assert native.clean_up_tokenization_spaces == hf.clean_up_tokenization_spaces


def test_vocabulary_and_special_tokens_match_autotokenizer(
    pair: tuple[NativeTokenizer, PreTrainedTokenizerBase],
) -> None:
    native, hf = pair
    assert len(native) == len(hf)
    assert native.get_vocab() == hf.get_vocab()
    assert native.all_special_ids == hf.all_special_ids
    assert native.special_tokens_map == hf.special_tokens_map
    ids = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "bos_token", "eos_token", "pad_token")
    assert {name: getattr(native, name) for name in ids} == {name: getattr(hf, name) for name in ids}
    assert native.unk_token == hf.unk_token
    assert native.vocab_size == hf.vocab_size
    assert native.model_max_length == hf.model_max_length
    assert native.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()


def test_chat_template_matches_autotokenizer(pair: tuple[NativeTokenizer, PreTrainedTokenizerBase]) -> None:
    native, hf = pair
    assert native.chat_template == hf.chat_template
    if hf.chat_template is None:
        pytest.skip("this tokenizer has no chat template")
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            text = hf.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
            assert native.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False) == text
            expected = hf.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)["input_ids"]
            assert native.apply_chat_template(messages, add_generation_prompt=prompt)["input_ids"] == expected
            assert apply_chat_template(native, messages) == apply_chat_template(hf, messages)


def test_a_template_refusal_is_the_same_error(base_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(base_dir, tmp_path / "rich")
    (tmp_path / "rich" / "chat_template.jinja").write_text(RICH_TEMPLATE)
    native, hf = tokenization.load(tmp_path / "rich"), AutoTokenizer.from_pretrained(tmp_path / "rich")
    messages = [{"role": "tool", "content": "42"}]
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        hf.apply_chat_template(messages)
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        native.apply_chat_template(messages)


def test_a_namespace_refuses_underscore_names_as_in_transformers(base_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(base_dir, tmp_path / "sneaky")
    (tmp_path / "sneaky" / "chat_template.jinja").write_text("{% set ns = namespace(_x=1) %}{{ ns._x }}")
    for tokenizer in (tokenization.load(tmp_path / "sneaky"), AutoTokenizer.from_pretrained(tmp_path / "sneaky")):
        with pytest.raises(jinja2.exceptions.SecurityError, match="underscore"):
            tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False)
