"""EngineConfig: sources, precedence, validation, and the example file."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from aioengine.config import CacheConfig, EngineConfig, ParallelConfig

EXAMPLE_TOML = Path(__file__).resolve().parent.parent / "config.example.toml"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no AIOENGINE_* variables, whatever the shell exports."""
    for name in list(os.environ):
        if name.upper().startswith("AIOENGINE_"):
            monkeypatch.delenv(name)


def write_toml(tmp_path: Path, text: str, name: str = "engine.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def sections() -> dict[str, type[BaseModel]]:
    return {name: field.annotation for name, field in EngineConfig.model_fields.items()}  # type: ignore[misc]


# --- defaults and precedence -------------------------------------------------


def test_defaults_need_no_arguments_and_no_environment() -> None:
    config = EngineConfig()
    assert config.model.path is None
    assert config.model.dtype == "auto"
    assert config.cache.block_size == 16
    assert config.cache.memory_utilization == 0.9
    assert config.scheduler.max_num_seqs == 64
    assert config.scheduler.max_num_batched_tokens == 512
    assert config.parallel.worker_cls == "auto"
    assert config.device.device == "auto"
    assert config.load.load_format == "safetensors"
    assert config.load.strict is True


def test_toml_overrides_default(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[cache]\nblock_size = 32\n")
    assert EngineConfig.from_toml(path).cache.block_size == 32


def test_environment_overrides_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toml(tmp_path, "[cache]\nblock_size = 32\n")
    monkeypatch.setenv("AIOENGINE_CACHE__BLOCK_SIZE", "64")
    assert EngineConfig.from_toml(path).cache.block_size == 64


def test_kwargs_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOENGINE_CACHE__BLOCK_SIZE", "64")
    assert EngineConfig(cache={"block_size": 128}).cache.block_size == 128


def test_from_toml_overrides_beat_environment_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toml(tmp_path, "[cache]\nblock_size = 32\n")
    monkeypatch.setenv("AIOENGINE_CACHE__BLOCK_SIZE", "64")
    assert EngineConfig.from_toml(path, cache={"block_size": 128}).cache.block_size == 128


def test_section_deep_merges_across_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toml(tmp_path, "[cache]\nnum_blocks = 100\n")
    monkeypatch.setenv("AIOENGINE_CACHE__BLOCK_SIZE", "32")
    cache = EngineConfig.from_toml(path, cache={"memory_utilization": 0.5}).cache
    assert (cache.num_blocks, cache.block_size, cache.memory_utilization) == (100, 32, 0.5)


def test_section_object_in_kwargs_overrides_only_the_fields_it_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_toml(tmp_path, "[cache]\nnum_blocks = 100\n")
    monkeypatch.setenv("AIOENGINE_CACHE__BLOCK_SIZE", "32")
    cache = EngineConfig.from_toml(path, cache=CacheConfig(memory_utilization=0.5)).cache
    assert (cache.num_blocks, cache.block_size, cache.memory_utilization) == (100, 32, 0.5)


# --- choosing the TOML file --------------------------------------------------


def test_config_env_var_selects_the_toml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toml(tmp_path, "[scheduler]\nmax_num_seqs = 7\n")
    monkeypatch.setenv("AIOENGINE_CONFIG", str(path))
    assert EngineConfig().scheduler.max_num_seqs == 7


def test_from_toml_path_wins_over_config_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOENGINE_CONFIG", str(write_toml(tmp_path, "[model]\nseed = 1\n", "env.toml")))
    path = write_toml(tmp_path, "[model]\nseed = 2\n", "explicit.toml")
    assert EngineConfig.from_toml(path).model.seed == 2


def test_config_env_var_is_not_taken_for_a_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = EngineConfig()
    monkeypatch.setenv("AIOENGINE_CONFIG", str(write_toml(tmp_path, "")))
    assert EngineConfig() == defaults


def test_from_toml_leaves_later_configs_without_a_file(tmp_path: Path) -> None:
    EngineConfig.from_toml(write_toml(tmp_path, "[model]\nseed = 5\n"))
    assert EngineConfig().model.seed == 0


def test_concurrent_from_toml_calls_each_read_their_own_file(tmp_path: Path) -> None:
    paths = [write_toml(tmp_path, f"[model]\nseed = {i}\n", f"{i}.toml") for i in range(8)]
    seeds: dict[int, int] = {}
    barrier = threading.Barrier(len(paths))

    def load(i: int) -> None:
        barrier.wait()
        seeds[i] = EngineConfig.from_toml(paths[i]).model.seed

    threads = [threading.Thread(target=load, args=(i,)) for i in range(len(paths))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seeds == {i: i for i in range(len(paths))}


def test_missing_toml_file_from_from_toml_is_an_error_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        EngineConfig.from_toml(missing)


def test_missing_toml_file_from_config_env_var_is_an_error_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nope.toml"
    monkeypatch.setenv("AIOENGINE_CONFIG", str(missing))
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        EngineConfig()


def test_malformed_toml_is_an_error_naming_the_path(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[cache\nblock_size = 16\n")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        EngineConfig.from_toml(path)


# --- validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cache.block_size", 0),
        ("cache.block_size", 24),
        ("cache.block_size", 512),
        ("cache.memory_utilization", 1.5),
        ("cache.memory_utilization", 0.0),
        ("cache.num_blocks", 0),
        ("device.device", "tpu"),
        ("device.device", "cuda:x"),
        ("model.dtype", "float64"),
        ("model.max_model_len", 0),
        ("scheduler.max_num_seqs", 0),
        ("parallel.tensor_parallel_size", 0),
        ("parallel.distributed_executor_backend", "mpi"),
        ("parallel.worker_cls", "Worker"),
        ("parallel.worker_extension_cls", "not a path"),
        ("load.load_format", "pt"),
    ],
)
def test_invalid_value_fails_naming_the_field(field: str, value: object) -> None:
    section, name = field.split(".")
    with pytest.raises(ValidationError, match=re.escape(field)):
        EngineConfig(**{section: {name: value}})


def test_block_size_error_says_what_is_allowed() -> None:
    with pytest.raises(ValidationError, match="power of two from 1 to 256"):
        EngineConfig(cache={"block_size": 24})


def test_device_error_lists_the_allowed_forms() -> None:
    with pytest.raises(ValidationError, match=re.escape("'auto', 'cpu', 'cuda' or 'cuda:N'")):
        EngineConfig(device={"device": "tpu"})


@pytest.mark.parametrize("block_size", [1, 2, 16, 256])
def test_power_of_two_block_sizes_are_accepted(block_size: int) -> None:
    assert EngineConfig(cache={"block_size": block_size}).cache.block_size == block_size


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_known_device_forms_are_accepted(device: str) -> None:
    assert EngineConfig(device={"device": device}).device.device == device


def test_unknown_field_in_toml_fails_naming_it(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[cache]\nblock_sise = 16\n")
    with pytest.raises(ValidationError, match=re.escape("cache.block_sise")):
        EngineConfig.from_toml(path)


def test_unknown_section_in_toml_fails_naming_it(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[caches]\nblock_size = 16\n")
    with pytest.raises(ValidationError, match="caches"):
        EngineConfig.from_toml(path)


def test_unknown_section_key_in_kwargs_fails_naming_it() -> None:
    with pytest.raises(ValidationError, match="bogus"):
        EngineConfig(bogus={"x": 1})


def test_unknown_field_in_kwargs_section_fails_naming_it() -> None:
    with pytest.raises(ValidationError, match=re.escape("scheduler.max_seqs")):
        EngineConfig(scheduler={"max_seqs": 4})


def test_unknown_field_in_environment_section_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOENGINE_CACHE__BLOCK_SISE", "16")
    with pytest.raises(ValidationError, match=re.escape("cache.block_sise")):
        EngineConfig()


def test_bad_int_from_environment_fails_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOENGINE_CACHE__NUM_BLOCKS", "lots")
    with pytest.raises(ValidationError, match=re.escape("cache.num_blocks")):
        EngineConfig()


def test_environment_values_are_parsed_to_field_types(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOENGINE_SCHEDULER__ENABLE_CHUNKED_PREFILL", "false")
    monkeypatch.setenv("AIOENGINE_CACHE__MEMORY_UTILIZATION", "0.5")
    config = EngineConfig()
    assert config.scheduler.enable_chunked_prefill is False
    assert config.cache.memory_utilization == 0.5


# --- worker extension ----------------------------------------------------------


class _Extension:
    def hello(self) -> str:
        return "hello"


def test_worker_extension_cls_accepts_a_class_object() -> None:
    config = EngineConfig(parallel={"worker_extension_cls": _Extension})
    assert config.parallel.worker_extension_cls is _Extension


def test_worker_extension_cls_accepts_a_class_object_inside_a_section_object() -> None:
    config = EngineConfig(parallel=ParallelConfig(worker_extension_cls=_Extension))
    assert config.parallel.worker_extension_cls is _Extension


def test_worker_extension_cls_accepts_a_dotted_name_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOENGINE_PARALLEL__WORKER_EXTENSION_CLS", "mypkg.ext.MyExtension")
    assert EngineConfig().parallel.worker_extension_cls == "mypkg.ext.MyExtension"


# --- documentation -------------------------------------------------------------


def test_every_field_has_a_description() -> None:
    undocumented = [
        f"{section}.{name}"
        for section, model in sections().items()
        for name, field in model.model_fields.items()
        if not field.description
    ]
    assert undocumented == []


def test_example_toml_loads_as_the_defaults() -> None:
    assert EngineConfig.from_toml(EXAMPLE_TOML) == EngineConfig()


def example_tables() -> dict[str, list[str]]:
    """The example file's lines grouped by ``[table]``."""
    tables: dict[str, list[str]] = {}
    current: list[str] = []
    for line in EXAMPLE_TOML.read_text().splitlines():
        if header := re.fullmatch(r"\[(\w+)\]", line.strip()):
            current = tables.setdefault(header.group(1), [])
        else:
            current.append(line)
    return tables


def field_line(lines: list[str], name: str) -> int | None:
    """Index of the line that sets ``name`` (possibly commented out), or None."""
    pattern = re.compile(rf"#?\s*{re.escape(name)}\s*=")
    return next((i for i, line in enumerate(lines) if pattern.match(line.strip())), None)


def test_example_toml_names_every_field_of_every_section() -> None:
    tables = example_tables()
    missing = [
        f"{section}.{name}"
        for section, model in sections().items()
        for name in model.model_fields
        if field_line(tables.get(section, []), name) is None
    ]
    assert missing == []


def test_example_toml_comments_every_field() -> None:
    tables = example_tables()
    uncommented = []
    for section, model in sections().items():
        lines = tables.get(section, [])
        for name in model.model_fields:
            index = field_line(lines, name)
            above = lines[index - 1].strip() if index else ""
            is_prose = above.startswith("#") and not re.match(r"#\s*\w+\s*=", above)
            if not is_prose:
                uncommented.append(f"{section}.{name}")
    assert uncommented == []
