"""Chat templates rendered as transformers renders them, with jinja2 alone (``NativeTokenizer``'s templates).

transformers' sandbox, reproduced: an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, loop controls, ``{% generation %}`` (its body only: the engine never asks for assistant
masks), ``tojson`` without ASCII escaping, ``raise_exception``, ``strftime_now``, a ``dict`` and a
``namespace`` without attributes a template could climb out through, and template data rebuilt from plain
JSON types (``template_data``). jinja2 is imported on the first compile, as transformers does: only chat
needs it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2

__all__ = ["compile_template", "template_data"]


def template_data(value: Any) -> Any:
    """transformers' ``_plain_template_data``: what a template sees is rebuilt from plain JSON types, anything
    else an inert placeholder, so the sandbox never meets an object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # a subclass (an enum...) back to the base type, without its own methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {template_data(key): template_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(template_data(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: template_data(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def compile_template(source: str) -> jinja2.Template:
    """A chat template in transformers' sandbox. jinja2 is imported here, as transformers does: only chat needs it."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.parser
    import jinja2.sandbox
    import jinja2.utils

    if tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit()) < (3, 1, 6):
        raise ImportError(
            f"chat templates need jinja2>=3.1.6 (older ones have sandbox escapes), not {jinja2.__version__}"
        )

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body (transformers' AssistantTracker also
        records where it lies, for assistant masks)."""

        tags = {"generation"}  # noqa: RUF012 - jinja's own class attribute

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore-prefixed names, out of reach of CPython internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: `self` may be a key
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, dict(*args, **kwargs))

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    class TemplateDict:
        """``dict(...)`` without a dict's attributes."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=TemplateDict(),
        namespace=Namespace,
    )
    return env.from_string(source)
