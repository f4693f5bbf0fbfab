"""Specification of which tokenizer aioengine loads (``aioengine.engine.tokenizer.load``): its own tokenizer
exactly where transformers builds the class the config names; what it does not reproduce goes to
``AutoTokenizer``, with a log line saying why; malformed files are named; loading and using it never imports
transformers; the engine encodes, decodes and chats through it by default.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from aioengine.engine import tokenizer as tokenization
from aioengine.engine.intake import load_tokenizer
from aioengine.engine.tokenizer import NativeTokenizer, TokenizerFiles, unsupported_reason
from aioengine.errors import CheckpointError
from aioengine.testing import SUPPORTED_TEST_ARCHS
from tests.engine_request_support import PROMPT, assert_text_is_the_decoded_ids, decoded, greedy
from tests.helpers import final
from tests.test_tokenizer_native import (
    BACKEND,
    CONFIG,
    CONVERSATIONS,
    _set,
    _write,
    base_dir_fixture,  # noqa: F401 - fixtures, imported for pytest to find: base_dir, checkpoints
    checkpoints_fixture,  # noqa: F401
)

# ---- where the native tokenizer stands in, and where it must not ----------------------------------------------


@pytest.mark.parametrize("arch", SUPPORTED_TEST_ARCHS)
def test_native_exactly_where_transformers_builds_the_config_class(checkpoints: dict[str, Path], arch: str) -> None:
    # qwen2 gets Qwen2Tokenizer from transformers (its model_type overrides the config's class): a pipeline
    # rebuilt from the vocabulary, so the native tokenizer must not stand in for it.
    reason = unsupported_reason(TokenizerFiles.read(checkpoints[arch]))
    hf_class = type(AutoTokenizer.from_pretrained(checkpoints[arch])).__name__
    assert (reason is None) == (hf_class == "TokenizersBackend"), (reason, hf_class)


def _remove(file: str) -> Callable[[Path], None]:
    return lambda d: (d / file).unlink()


NOT_REPRODUCED: dict[str, tuple[Callable[[Path], None], str]] = {
    "tokenizer-class": (_set(CONFIG, tokenizer_class="GPT2Tokenizer"), "GPT2Tokenizer"),
    "no-tokenizer-config": (_remove(CONFIG), "no tokenizer_config.json"),
    "no-tokenizer-json": (_remove(BACKEND), "no tokenizer.json"),
    "remote-code": (_set(CONFIG, auto_map={"AutoTokenizer": ["tok.Tok", None]}), "auto_map"),
    "mistral-regex": (_set(CONFIG, fix_mistral_regex=True), "fix_mistral_regex"),
    "added-tokens-json": (_write("added_tokens.json", '{"<new>": 1024}'), "added_tokens.json"),
    "model-type": (_write("config.json", '{"model_type": "qwen2"}'), "'qwen2'"),
}


@pytest.mark.parametrize("case", NOT_REPRODUCED)
def test_what_the_native_tokenizer_does_not_reproduce_is_named(base_dir: Path, tmp_path: Path, case: str) -> None:
    edit, named = NOT_REPRODUCED[case]
    shutil.copytree(base_dir, tmp_path / "t")
    edit(tmp_path / "t")
    assert named in (unsupported_reason(TokenizerFiles.read(tmp_path / "t")) or "")


def test_auto_falls_back_to_autotokenizer_and_says_why(
    checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aioengine.engine.tokenizer")
    tokenizer = tokenization.load(checkpoints["qwen2"], "auto")
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert any("AutoTokenizer" in r.getMessage() and "qwen2" in r.getMessage() for r in caplog.records)


def test_hf_mode_always_gives_autotokenizer(checkpoints: dict[str, Path]) -> None:
    tokenizer = tokenization.load(checkpoints["llama"], "hf")
    assert isinstance(tokenizer, PreTrainedTokenizerBase) and not isinstance(tokenizer, NativeTokenizer)


def test_a_malformed_tokenizer_file_is_named(base_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(base_dir, tmp_path / "t")
    (tmp_path / "t" / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(CheckpointError, match=r"t/tokenizer\.json"):
        tokenization.load(tmp_path / "t")
    (tmp_path / "t" / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"t/tokenizer_config\.json holds a JSON list"):
        tokenization.load(tmp_path / "t")


def test_a_special_token_transformers_refuses_is_refused(base_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(base_dir, tmp_path / "t")  # an object without "__type": "AddedToken" is no token to transformers
    _set(CONFIG, eos_token={"content": "<|eos|>"})(tmp_path / "t")
    with pytest.raises(TypeError):
        AutoTokenizer.from_pretrained(tmp_path / "t")
    with pytest.raises(CheckpointError, match="eos_token"):
        tokenization.load(tmp_path / "t")


def test_loading_and_using_it_never_imports_transformers(checkpoints: dict[str, Path]) -> None:
    code = f"""
import sys
from aioengine.engine.intake import apply_chat_template, load_tokenizer
tokenizer, _ = load_tokenizer({str(checkpoints["llama"])!r})
ids = tokenizer("Hello, world", add_special_tokens=False).input_ids
tokenizer.decode(ids, skip_special_tokens=True)
apply_chat_template(tokenizer, [{{"role": "user", "content": "Hi"}}])
print(type(tokenizer).__name__, "transformers" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["NativeTokenizer", "False"], result.stderr


def test_load_tokenizer_reports_the_longest_token(checkpoints: dict[str, Path]) -> None:
    _, longest = load_tokenizer(str(checkpoints["llama"]))
    assert longest == max(
        len(token.encode()) for token in AutoTokenizer.from_pretrained(checkpoints["llama"]).get_vocab()
    )


# ---- the engine ------------------------------------------------------------------------------------------------


async def test_the_engine_uses_the_native_tokenizer_by_default(llama_engine: Any, tokenizer: Any) -> None:
    assert isinstance(llama_engine.tokenizer, NativeTokenizer)
    out = await final(llama_engine, PROMPT, greedy(12, ignore_eos=True))
    assert out.prompt_token_ids == tokenizer(PROMPT).input_ids
    assert_text_is_the_decoded_ids(out.text, decoded(tokenizer, out.token_ids))


async def test_the_engine_chats_through_the_native_tokenizer(llama_engine: Any, tokenizer: Any) -> None:
    messages = CONVERSATIONS[2]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert llama_engine.chat_prompt_ids(messages) == expected
    outputs = []
    async for item in llama_engine.generate(messages=messages, params=greedy(8, ignore_eos=True)):
        outputs.append(item)
    assert outputs[-1].prompt_token_ids == expected
    assert_text_is_the_decoded_ids(outputs[-1].text, decoded(tokenizer, outputs[-1].token_ids))
