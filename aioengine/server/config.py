"""What ``aioengine serve`` runs: a ``[server]`` section and a ``[models]`` table beside the engine's sections.

One TOML file configures the whole server::

    [server]
    port = 8000
    admin_key = "..."          # or AIOENGINE_ADMIN_KEY; admin endpoints are off without one
    budget_bytes = 8_000_000_000

    [cache]                    # the engine sections: defaults for every model
    num_blocks = 1024

    [models.smol.model]        # one table per served model name: that model's engine sections
    path = "/models/SmolLM2-135M-Instruct"
    [models.qwen.model]
    path = "/models/Qwen2.5-0.5B-Instruct"

Without a ``[models]`` table the engine sections describe the one model served. The first model listed is
awake when the server starts; the others wake when a request names them.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aioengine.config import EngineConfig
from aioengine.messages import SleepLevel

ShutdownMode = Literal["finish", "abort"]
"""On SIGTERM / Ctrl-C: let requests in flight finish (up to ``shutdown_timeout``), or abort them at once."""

API_KEY_ENV = "AIOENGINE_API_KEY"
ADMIN_KEY_ENV = "AIOENGINE_ADMIN_KEY"


class ServerConfig(BaseModel):
    """The ``[server]`` section; flags of ``aioengine serve`` override it."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 exposes the server to the network.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind; 0 picks a free one (the start line names it).")
    api_key: str | None = Field(None, description=f"Bearer key for /v1/*, /tokenize and /detokenize ({API_KEY_ENV}).")
    admin_key: str | None = Field(
        None, description=f"Bearer key of the admin endpoints, which are off without one ({ADMIN_KEY_ENV})."
    )
    shutdown: ShutdownMode = Field("finish", description="What SIGTERM / Ctrl-C does to requests in flight.")
    shutdown_timeout: float = Field(30.0, ge=0, description="Seconds 'finish' waits before aborting what is left.")
    budget_bytes: int | None = Field(None, ge=1, description="Device bytes the awake models may hold together.")
    max_awake: int | None = Field(None, ge=1, description="Most models awake at once.")
    idle_timeout: float | None = Field(None, gt=0, description="Seconds idle before a model is put to sleep.")
    sleep_level: SleepLevel = Field(1, description="How the pool puts a model to sleep to make room (1 or 2).")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "warning"


ENGINE_SECTIONS = frozenset(EngineConfig.model_fields)


def load(
    path: str | os.PathLike[str] | None,
    server: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
) -> tuple[ServerConfig, dict[str, dict[str, Any]], dict[str, Any]]:
    """Reads the file: the server section (``server`` overrides on top, keys from the environment where the
    file has none), each model's engine sections (the shared ones merged under its own) and the shared
    engine sections with ``engine`` overrides. Every problem names the file and the key."""
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"config file {str(file)!r} does not exist or is not a file")
        try:
            data = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {str(file)!r} is not valid TOML: {exc}") from exc
    section = dict(data.pop("server", {}))
    models = data.pop("models", {})
    unknown = set(data) - ENGINE_SECTIONS
    if unknown:
        raise ValueError(f"config file {path!s}: unknown sections {sorted(unknown)}; known: server, models, "
                         f"{', '.join(sorted(ENGINE_SECTIONS))}")  # fmt: skip
    section.setdefault("api_key", os.environ.get(API_KEY_ENV) or None)
    section.setdefault("admin_key", os.environ.get(ADMIN_KEY_ENV) or None)
    section.update({k: v for k, v in (server or {}).items() if v is not None})
    shared = merge(data, engine or {})
    if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
        raise ValueError(f"config file {path!s}: [models] must hold one table per model name")
    return ServerConfig(**section), {name: merge(shared, table) for name, table in models.items()}, shared


def engine_config(name: str, sections: dict[str, Any]) -> EngineConfig:
    try:
        return EngineConfig(**sections)
    except ValidationError as exc:
        raise ValueError(f"model {name!r}: {exc}") from exc


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = (
            merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged
