"""HTTP errors in OpenAI's shape, and which engine error becomes which status."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from aioengine.errors import (
    CheckpointError,
    ConfigurationError,
    EngineDeadError,
    EngineNotStartedError,
    EngineStateError,
    InvalidRequestError,
    UnknownModelError,
    WeightsLostError,
)
from aioengine.server.protocol import error_body


class APIError(Exception):
    """An error the client gets as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming every field pydantic refused (``param`` is the first), e.g. from ``SamplingParams``."""
    return field_errors(exc.errors())


def field_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """Pydantic's (or FastAPI's) error list as one 400: ``max_tokens: Input should be a valid integer; ...``.
    FastAPI's leading ``body`` is dropped from each location (the client named ``max_tokens``), and so are
    pydantic's union branch tags (``prompt.list[int]`` is the client's ``prompt``)."""
    by_field: dict[str, list[str]] = {}
    for error in errors:
        if error.get("type") == "json_invalid":  # its location is a character position, not a field
            return APIError(400, _reason(error))
        loc = [str(part) for part in error.get("loc", ())]
        if loc[:1] == ["body"]:
            loc = loc[1:]
        where = ".".join(part for part in loc if not _UNION_TAG.fullmatch(part))
        if not where and error.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            return APIError(400, "the request body must be a JSON object (Content-Type: application/json)")
        reasons = by_field.setdefault(where, [])
        if _reason(error) not in reasons:
            reasons.append(_reason(error))
    problems = [
        f"{where}: {' | '.join(reasons)}" if where else " | ".join(reasons) for where, reasons in by_field.items()
    ]
    first = next(iter(by_field), "")
    return APIError(400, "; ".join(problems) or "invalid request", param=first or None)


_UNION_TAG = re.compile(r"str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z]\w*")
"""How pydantic names the branch of a union in an error location (``str``, ``list[int]``, ``TextPart``)."""


def _reason(error: Mapping[str, Any]) -> str:
    if error.get("type") == "extra_forbidden":
        return "unsupported field (this server does not implement it)"
    if error.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')})"
    message = str(error.get("msg", "invalid"))
    return message.removeprefix("Value error, ")


def engine_error(exc: Exception) -> APIError:
    """The HTTP face of an exception from the engine or the pool."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    if isinstance(exc, UnknownModelError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, WeightsLostError):  # a source broke half-way: the engine serves nothing until a full write
        return APIError(500, str(exc), type_="server_error", code="weights_lost")
    if isinstance(exc, CheckpointError):  # a weight source that does not fit: nothing was changed
        return APIError(400, str(exc), code="bad_checkpoint")
    if isinstance(exc, EngineDeadError | EngineNotStartedError):
        return APIError(503, str(exc), type_="server_error", code="engine_unavailable")
    if isinstance(exc, EngineStateError):
        return APIError(409, str(exc), type_="invalid_request_error", code="engine_state")
    if isinstance(exc, ConfigurationError):
        return APIError(500, str(exc), type_="server_error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error")
