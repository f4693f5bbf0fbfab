"""The tokenizer that ``aioengine.engine.tokenizer.build`` makes: transformers 5's ``TokenizersBackend`` as the
engine, its server and its tests use it, on a ``tokenizers.Tokenizer`` set up as transformers sets it up.

What its methods reproduce:

- decoding: the backend's, then ``clean_up_tokenization_spaces`` (default False), which transformers skips for a
  BPE model unless ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`` is set.
- chat templates: chat_template.jinja (with additional_chat_templates/*.jinja), else tokenizer_config.json's
  ``chat_template`` (a string or a list of named templates, "default" used), rendered in transformers' sandbox:
  same environment options, ``tojson``, ``raise_exception``, ``strftime_now``, ``dict``, ``namespace``,
  ``{% generation %}`` (its body only: the engine never asks for assistant masks), messages without their
  None-valued keys and with the reasoning fields aliased, every special token as a variable.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, models

from aioengine.engine.chat_template import compile_template, template_data

if TYPE_CHECKING:
    import jinja2

__all__ = ["Encoding", "NativeTokenizer"]

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""The names a message's reasoning goes by; templates read the first (and gpt-oss's the second)."""

CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # fmt: skip
"""transformers' ``clean_up_tokenization``, in its order: spaces a WordPiece-style decoder puts before punctuation."""


class Encoding(Mapping[str, list[int]]):
    """A text's token ids, read as ``.input_ids`` or ``["input_ids"]`` like transformers' ``BatchEncoding``."""

    __slots__ = ("input_ids",)

    def __init__(self, input_ids: list[int]) -> None:
        self.input_ids = input_ids

    def __getitem__(self, key: str) -> list[int]:
        if key != "input_ids":
            raise KeyError(key)
        return self.input_ids

    def __iter__(self) -> Iterator[str]:
        return iter(self.__slots__)

    def __len__(self) -> int:
        return 1


class NativeTokenizer:
    """The part of a transformers tokenizer that the engine, its server and its tests use, and the everyday
    methods callers of ``engine.tokenizer`` reach for (``encode``, ``batch_decode``, the token / id
    conversions, the special tokens and ``vocab_size``), with the same results.

    ``backend_tokenizer`` is the ``tokenizers.Tokenizer``; ``chat_template`` a string, or a dict of named
    templates, or None, as transformers has it."""

    def __init__(
        self,
        backend: Tokenizer,
        special_tokens: dict[str, str],
        extra_special_tokens: list[str],
        *,
        model_max_length: int,
        clean_up_tokenization_spaces: bool,
        clean_up_bpe: bool,
        chat_template: str | dict[str, str] | None,
    ) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = special_tokens
        """Each named special token (``bos_token``, ...; model-specific ones too) as a string, as in transformers."""
        self.model_max_length = model_max_length
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.chat_template = chat_template
        self._cleans_bpe = clean_up_bpe
        unique = dict.fromkeys([*special_tokens.values(), *extra_special_tokens])
        self._special_ids = [self._token_id(token) for token in unique]

    def _token_id(self, token: str | None) -> int | None:
        """transformers' ``convert_tokens_to_ids``: a token the vocabulary lacks is the unknown token."""
        if token is None:
            return None
        index = self.backend_tokenizer.token_to_id(token)
        if index is None and (unknown := self.special_tokens_map.get("unk_token")) is not None:
            index = self.backend_tokenizer.token_to_id(unknown)
        return index

    @property
    def all_special_ids(self) -> list[int | None]:
        return list(self._special_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.special_tokens_map.get("bos_token"))

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id(self.special_tokens_map.get("eos_token"))

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id(self.special_tokens_map.get("pad_token"))

    @property
    def unk_token_id(self) -> int | None:
        return self._token_id(self.special_tokens_map.get("unk_token"))

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (``len`` counts them), as in transformers."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens).input_ids

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int | None] | None:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str | None] | None:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text: str = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and (
            self._cleans_bpe or not isinstance(self.backend_tokenizer.model, models.BPE)
        ):
            for spaced, tight in CLEAN_UP:
                text = text.replace(spaced, tight)
        return text

    def apply_chat_template(
        self, conversation: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False, tokenize: bool = True
    ) -> Encoding | str:
        """One conversation through the chat template; the text, or its ids (tokenized without special tokens)."""
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        messages = []
        for message in conversation:
            if not isinstance(message, Mapping):
                raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
            plain = template_data({key: value for key, value in message.items() if value is not None})
            reasoning = next((plain[key] for key in REASONING_FIELDS if plain.get(key) is not None), None)
            messages.append(
                plain if reasoning is None else {"thinking": reasoning, **plain, "reasoning_content": reasoning}
            )
        text = self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **template_data(self.special_tokens_map),
        )
        return self(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _template(self) -> jinja2.Template:
        template = self.chat_template
        if isinstance(template, dict):
            if "default" not in template:
                raise ValueError(
                    "This model has multiple chat templates with no default specified! Available template names "
                    f"are {sorted(template)}."
                )
            template = template["default"]
        if template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
        return compile_template(template)
