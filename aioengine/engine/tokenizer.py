"""aioengine's own tokenizer: what transformers' ``AutoTokenizer`` gives, built on the ``tokenizers`` library and
jinja2 alone, so that starting an engine never imports transformers.

Why: engine start-up must stay under 5 s, and transformers alone costs most of that: measured in fresh processes
(torch imported first, a shared 2-core machine) on SmolLM2-135M-Instruct, ``import transformers`` takes 1.9-2.1 s
and ``AutoTokenizer.from_pretrained`` 1.8-2.6 s more (its lazy imports pull in the config classes, modeling
machinery and torch.distributed.tensor), 3.7-4.6 s in all, while ``load`` here takes 0.15-0.24 s, nearly all of
it ``tokenizers.Tokenizer.from_file`` reading tokenizer.json.

What it reproduces is transformers 5's ``TokenizersBackend``, the class ``AutoTokenizer`` builds when
tokenizer_config.json names ``TokenizersBackend`` or ``PreTrainedTokenizerFast`` and tokenizer.json exists:

- encoding: tokenizer.json's pipeline as is, with its truncation and padding off (transformers turns them off
  on every call that does not ask for them) and ``split_special_tokens``; ``add_bos_token`` / ``add_eos_token``
  are ignored, as transformers ignores them whenever there is a tokenizer.json; no post-processor becomes an
  empty template, as there.
- special tokens: the named ones (``bos_token`` ... ``mask_token``, plus any other ``*_token`` key, which
  transformers treats as a model-specific special token), ``extra_special_tokens`` /
  ``additional_special_tokens``, ``added_tokens_decoder``, else ``special_tokens_map.json`` and
  tokenizer.json's added tokens; those missing from the vocabulary are added as transformers adds them (the
  same ``tokenizers`` calls on the same ``AddedToken`` objects), so ``len``, the ids and what
  ``skip_special_tokens`` skips agree.
- decoding and chat templates: ``NativeTokenizer``'s (``aioengine.engine.native_tokenizer``), which says what
  they reproduce.

Everything else is left to transformers: ``unsupported_reason`` names each case, and ``load`` in mode "auto"
then builds ``AutoTokenizer`` and logs why.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, processors

from aioengine.config import TokenizerMode
from aioengine.engine.native_tokenizer import Encoding, NativeTokenizer
from aioengine.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Encoding", "NativeTokenizer", "TokenizerFiles", "build", "load", "unsupported_reason"]

logger = logging.getLogger(__name__)

NATIVE_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""tokenizer_class values that transformers 5 builds as a ``TokenizersBackend`` (the second is its alias)."""

CHECKED_MODEL_TYPES = (None, "llama", "mistral", "qwen3")
"""config.json model types (None: no config.json, or no model_type in it) for which ``AutoTokenizer`` builds the
tokenizer_config's class, checked against transformers by the tests. For some others it picks a class of its
own that rebuilds the pipeline (qwen2 gets ``Qwen2Tokenizer``: another pre-tokenizer, NFC, one more token)."""

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
VERY_LARGE_INTEGER = int(1e30)
"""transformers' ``model_max_length`` when the config gives none."""

SpecialToken = str | AddedToken


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    """What a tokenizer directory holds, read once: both the check and the build work from it."""

    directory: Path
    config: dict[str, Any] | None
    """tokenizer_config.json; None when absent."""
    model_type: str | None
    """config.json's model_type: transformers picks the tokenizer class by it too."""
    special_tokens_map: dict[str, Any] | None
    chat_templates: dict[str, str]
    """chat_template.jinja as "default", and additional_chat_templates/NAME.jinja as NAME."""

    @classmethod
    def read(cls, directory: str | Path) -> TokenizerFiles:
        directory = Path(directory)
        templates = {}
        if (directory / "chat_template.jinja").is_file():
            templates["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        for file in sorted((directory / "additional_chat_templates").glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
        return cls(
            directory,
            _read_object(directory / "tokenizer_config.json"),
            (_read_object(directory / "config.json") or {}).get("model_type"),
            _read_object(directory / "special_tokens_map.json"),
            templates,
        )


def _read_object(file: Path) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}; fix or replace the file") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{file} holds a JSON {type(value).__name__}, not an object; fix or replace the file")
    return value


def unsupported_reason(files: TokenizerFiles) -> str | None:
    """Why the native tokenizer cannot stand in for ``AutoTokenizer`` on these files; None when it can."""
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        version = None
    if version is not None and not version.startswith("5."):
        return f"transformers {version} is installed, and the native tokenizer reproduces transformers 5"
    if not (files.directory / "tokenizer.json").is_file():
        return "there is no tokenizer.json (transformers converts the tokenizer from the other files)"
    config = files.config
    if config is None:
        return "there is no tokenizer_config.json naming the tokenizer class"
    if (name := config.get("tokenizer_class")) is None:
        return "tokenizer_config.json names no tokenizer_class (transformers then picks one by the model type)"
    if name not in NATIVE_CLASSES:
        return f"tokenizer_config.json names tokenizer_class {name!r}, which transformers builds in its own way"
    for key, why in (
        ("auto_map", "a tokenizer class of the checkpoint's own code"),
        ("fast_tokenizer_files", "versioned tokenizer files"),
        ("fix_mistral_regex", "a patched pre-tokenizer"),
    ):
        if config.get(key):
            return f"tokenizer_config.json sets {key} ({why})"
    if "added_tokens_decoder" not in config and (files.directory / "added_tokens.json").is_file():
        return "there is a legacy added_tokens.json"
    if files.model_type not in CHECKED_MODEL_TYPES:
        return f"transformers may give config.json's model_type {files.model_type!r} a tokenizer class of its own"
    return None


def _load_backend(file: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(f"cannot read {file}: {exc}; fix or replace the file") from exc


def _added_tokens_from_json(value: Any) -> Any:
    """transformers' ``convert_added_tokens``: every ``{"__type": "AddedToken", ...}`` object, at any depth."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        return AddedToken(**{k: v for k, v in value.items() if k != "__type"})
    if isinstance(value, list | tuple):
        return [_added_tokens_from_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _added_tokens_from_json(v) for k, v in value.items()}
    return value


def _init_kwargs(files: TokenizerFiles, backend: Tokenizer) -> dict[str, Any]:
    """What ``TokenizersBackend.__init__`` receives from transformers' ``_from_pretrained`` (a local directory
    with a tokenizer.json), step by step in its order: the order decides which special tokens come first."""
    init = dict(files.config or {})
    for key in ("tokenizer_class", "init_inputs", "add_bos_token", "add_eos_token"):
        init.pop(key, None)
    if list(files.chat_templates) == ["default"]:
        init["chat_template"] = files.chat_templates["default"]
    elif files.chat_templates:
        init["chat_template"] = dict(files.chat_templates)
    if "additional_special_tokens" in init and not init.get("extra_special_tokens"):
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    model_specific = {
        key: init.pop(key)
        for key in list(init)
        if key not in NAMED_TOKENS and key.endswith("_token") and isinstance(init[key], str)
    }
    if isinstance(init.get("extra_special_tokens"), dict):
        model_specific.update(init.pop("extra_special_tokens"))
    if model_specific:
        init["model_specific_special_tokens"] = model_specific

    decoder: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in init:
        for index, entry in init["added_tokens_decoder"].items():
            decoder[int(index)] = AddedToken(**entry) if isinstance(entry, dict) else entry
    else:
        for key, value in (files.special_tokens_map or {}).items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = AddedToken(**{k: v for k, v in value.items() if k != "special"}, special=True)
            elif key == "extra_special_tokens" and isinstance(value, list):
                merged = list(init.get("extra_special_tokens") or [])
                for token in value:
                    token = AddedToken(**token, special=True) if isinstance(token, dict) else token
                    if token not in merged:
                        merged.append(token)
                value = merged
            init[key] = value
        if isinstance(init.get("extra_special_tokens"), dict):
            init.setdefault("model_specific_special_tokens", {}).update(init.pop("extra_special_tokens"))
        decoder = dict(backend.get_added_tokens_decoder())
    by_content = {str(token): token for token in decoder.values()}
    init["added_tokens_decoder"] = decoder
    init = {key: _added_tokens_from_json(value) for key, value in init.items()}
    for key in NAMED_TOKENS:
        if by_content and init.get(key) is not None:
            init[key] = by_content.get(str(init[key]), init[key])
    return init


def build(files: TokenizerFiles) -> NativeTokenizer:
    """The native tokenizer of files that ``unsupported_reason`` accepts: transformers' ``TokenizersBackend``
    set-up (and its ``PreTrainedTokenizerBase.__init__``), applied to the same ``tokenizers`` objects."""
    backend = _load_backend(files.directory / "tokenizer.json")
    init = _init_kwargs(files, backend)
    if (padding := backend.padding) is not None:
        init.setdefault("pad_token", padding["pad_token"])
    backend.no_truncation()
    backend.no_padding()
    if "additional_special_tokens" in init and "extra_special_tokens" not in init:
        init["extra_special_tokens"] = init.pop("additional_special_tokens")

    special: dict[str, SpecialToken | None] = dict.fromkeys(NAMED_TOKENS)
    extras: list[SpecialToken] = []
    guessed: dict[str, SpecialToken] = {}  # other *_token keys holding a token: model-specific special tokens
    for key in list(init):
        value = init[key]
        if key in NAMED_TOKENS or key == "extra_special_tokens":
            init.pop(key)
            if value is None:
                continue
            if key == "extra_special_tokens" and isinstance(value, dict):
                special.update(value)
            elif key == "extra_special_tokens" and isinstance(value, list | tuple):
                extras = list(value)
            elif key in NAMED_TOKENS and isinstance(value, str | AddedToken):
                special[key] = value
            else:
                raise CheckpointError(
                    f"{key} in {files.directory}'s tokenizer_config.json / special_tokens_map.json is {value!r}; "
                    'transformers takes a string or {"__type": "AddedToken", "content": ...} there (a list for '
                    "extra_special_tokens); fix the file"
                )
        elif key.endswith("_token") and isinstance(value, str | AddedToken):
            guessed[key] = init.pop(key)
    special.update({**guessed, **(init.pop("model_specific_special_tokens", None) or {})})
    backend.encode_special_tokens = bool(init.get("split_special_tokens", False))

    # The config's added tokens first, all of them (transformers filters them by comparing each token's repr with
    # the backend's added-token *ids*, which never matches), then any special token the backend lacks; a named one
    # is made special if it was not.
    to_add: list[SpecialToken] = [token for _, token in sorted(init["added_tokens_decoder"].items(), key=_first)]
    known = [token.content for _, token in sorted(backend.get_added_tokens_decoder().items(), key=_first)]
    known += [str(token) for token in to_add]
    for token in [*(t for t in special.values() if t is not None), *extras]:
        if str(token) not in known and token not in to_add:
            to_add.append(token)
    if to_add:
        named = [str(t) for t in special.values() if t]
        tokens = []
        for token in to_add:
            if isinstance(token, str):
                token = AddedToken(token, special=True)
            elif not token.special and str(token) in named:
                token.special = True
            tokens.append(token)
        backend.add_tokens(tokens)
    if backend.post_processor is None:
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])

    max_length = init["model_max_length"] if "model_max_length" in init else init.get("max_len")
    template = init.get("chat_template")
    if isinstance(template, list | tuple):
        template = {entry["name"]: entry["template"] for entry in template}
    return NativeTokenizer(
        backend,
        {key: str(value) for key, value in special.items() if value is not None},
        [str(token) for token in extras],
        model_max_length=max_length if max_length is not None else VERY_LARGE_INTEGER,
        clean_up_tokenization_spaces=bool(init.get("clean_up_tokenization_spaces", False)),
        clean_up_bpe=bool(init.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")),
        chat_template=template,
    )


def _first(item: tuple[int, AddedToken]) -> int:
    return item[0]


def load(path: str | Path, mode: TokenizerMode = "auto") -> NativeTokenizer | PreTrainedTokenizerBase:
    """The tokenizer of a checkpoint (or tokenizer) directory: the native one in mode "auto" wherever it gives
    what ``AutoTokenizer`` gives, else (and always in mode "hf") ``AutoTokenizer`` itself."""
    if mode == "auto":
        files = TokenizerFiles.read(path)
        reason = unsupported_reason(files)
        if reason is None:
            return build(files)
        logger.info("tokenizer of %s: transformers' AutoTokenizer (slower to start), because %s", path, reason)
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return tokenizer
