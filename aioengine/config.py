"""Engine configuration: one ``EngineConfig`` with a section per layer.

Sources, strongest first: keyword arguments, environment variables
(``AIOENGINE_`` prefix, ``__`` between section and field, e.g.
``AIOENGINE_CACHE__BLOCK_SIZE=32``), a TOML file, defaults. Sections deep-merge
across sources, so each source may set a different field of the same section.

The TOML file is the one given to :meth:`EngineConfig.from_toml`, else the one
named by ``AIOENGINE_CONFIG``, else none. ``config.example.toml`` documents every
field. Invalid values raise :class:`pydantic.ValidationError` at construction,
naming the field (``cache.block_size``).

The sections themselves, one model per layer with its defaults and checks, live in
``aioengine.config_sections``; this module gathers them from their sources and
offers every name of theirs too.

This is a bottom module: it imports nothing from aioengine but its sections, and never torch.
"""

from __future__ import annotations

import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from aioengine.config_sections import CacheConfig as CacheConfig
from aioengine.config_sections import CompileConfig as CompileConfig
from aioengine.config_sections import DeviceConfig as DeviceConfig
from aioengine.config_sections import DType as DType
from aioengine.config_sections import LoadConfig as LoadConfig
from aioengine.config_sections import ModelConfig as ModelConfig
from aioengine.config_sections import ParallelConfig as ParallelConfig
from aioengine.config_sections import PreemptionMode as PreemptionMode
from aioengine.config_sections import ProfilerConfig as ProfilerConfig
from aioengine.config_sections import SchedulerConfig as SchedulerConfig
from aioengine.config_sections import SleepConfig as SleepConfig
from aioengine.config_sections import TokenizerMode as TokenizerMode
from aioengine.config_sections import _Section

__all__ = [
    "CONFIG_ENV_VAR",
    "CacheConfig",
    "CompileConfig",
    "DeviceConfig",
    "EngineConfig",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "ProfilerConfig",
    "SchedulerConfig",
    "SleepConfig",
]

CONFIG_ENV_VAR = "AIOENGINE_CONFIG"
"""Environment variable naming the TOML file when ``from_toml`` is not used."""

# The TOML path of the EngineConfig being built in this thread/task. A ContextVar
# rather than a class attribute so concurrent from_toml calls cannot see each other's.
_toml_path: ContextVar[Path | None] = ContextVar("aioengine_config_toml_path", default=None)


def _merge_section_objects(init_settings: PydanticBaseSettingsSource) -> PydanticBaseSettingsSource:
    """Let a section object in the kwargs override only the fields it was given.

    pydantic-settings deep-merges dicts across sources but takes a model object
    whole, so ``EngineConfig(cache=CacheConfig(num_blocks=8))`` would silently
    drop ``cache.block_size`` set in the environment or TOML file.
    """
    if not isinstance(init_settings, InitSettingsSource):
        return init_settings
    kwargs = {
        name: value.model_dump(exclude_unset=True) if isinstance(value, _Section) else value
        for name, value in init_settings.init_kwargs.items()
    }
    return InitSettingsSource(init_settings.settings_cls, init_kwargs=kwargs)


class EngineConfig(BaseSettings):
    """Everything the engine can be configured with, one section per layer."""

    model_config = SettingsConfigDict(
        env_prefix="AIOENGINE_",
        env_nested_delimiter="__",
        extra="forbid",
        case_sensitive=False,
    )

    model: ModelConfig = Field(default_factory=ModelConfig, description="Checkpoint and dtype.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Paged KV cache.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Batching limits.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Workers and executor.")
    device: DeviceConfig = Field(default_factory=DeviceConfig, description="Device and CPU threads.")
    load: LoadConfig = Field(default_factory=LoadConfig, description="Weight loading.")
    compile: CompileConfig = Field(default_factory=CompileConfig, description="CUDA graphs / padded buckets.")
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig, description="torch profiler traces.")
    sleep: SleepConfig = Field(default_factory=SleepConfig, description="Sleep / wake back end.")

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> EngineConfig:
        """Build a config from the TOML file at ``path``.

        Environment variables still override the file, and ``overrides`` (keyword
        arguments as to the constructor) override both. A missing file is an error.
        """
        token = _toml_path.set(Path(path).expanduser())
        try:
            return cls(**overrides)
        finally:
            _toml_path.reset(token)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Kwargs, then environment, then the TOML file; no .env or secrets files."""
        sources = (_merge_section_objects(init_settings), env_settings)
        path = _toml_path.get()
        named_by = "EngineConfig.from_toml"
        if path is None and (env_value := os.environ.get(CONFIG_ENV_VAR)):
            path, named_by = Path(env_value).expanduser(), CONFIG_ENV_VAR
        if path is None:
            return sources
        # TomlConfigSettingsSource silently skips a missing file; a file the user named must exist.
        if not path.is_file():
            raise FileNotFoundError(
                f"config file {str(path)!r} (named by {named_by}) does not exist or is not a file; "
                "fix the path or copy config.example.toml there"
            )
        try:
            toml_source = TomlConfigSettingsSource(settings_cls, toml_file=path)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {str(path)!r} is not valid TOML: {exc}") from exc
        return (*sources, toml_source)
