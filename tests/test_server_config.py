"""`aioengine serve`'s configuration: the [server] section, the [models] table and the flags over them."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from aioengine.server import config
from aioengine.server.config import ServerConfig
from aioengine.server.launch import configure

EXAMPLE_TOML = Path(__file__).resolve().parent.parent / "config.example.toml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.toml"
    path.write_text(text)
    return path


def _args(**given: object) -> argparse.Namespace:
    fields = dict.fromkeys(
        ("config", "host", "port", "api_key", "admin_key", "shutdown", "shutdown_timeout", "device", "model",
         "served_model", "served_model_name"),
    )  # fmt: skip
    return argparse.Namespace(**{**fields, "verbose": False, **given})


def test_without_a_file_the_server_binds_localhost_with_admin_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(config.API_KEY_ENV, raising=False)
    monkeypatch.delenv(config.ADMIN_KEY_ENV, raising=False)
    server, models, shared = config.load(None)
    assert (server.host, server.port, server.admin_key, server.api_key) == ("127.0.0.1", 8000, None, None)
    assert models == {} and shared == {}


def test_keys_come_from_the_environment_and_flags_override_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(config.ADMIN_KEY_ENV, "from-env")
    monkeypatch.delenv(config.API_KEY_ENV, raising=False)
    path = _write(tmp_path, '[server]\nport = 9000\napi_key = "from-file"\n')
    server, _, _ = config.load(path, {"port": 9100, "host": None})
    assert (server.port, server.api_key, server.admin_key, server.host) == (9100, "from-file", "from-env", "127.0.0.1")


def test_each_model_gets_the_shared_sections_under_its_own(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
[cache]
num_blocks = 64
block_size = 32
[device]
device = "cpu"
[models.a.model]
path = "/m/a"
[models.b.model]
path = "/m/b"
[models.b.cache]
num_blocks = 8
""",
    )
    _, models, _ = config.load(path, engine={"device": {"device": "cuda"}})
    assert list(models) == ["a", "b"]
    a, b = (config.engine_config(name, table) for name, table in models.items())
    assert (a.model.path, a.cache.num_blocks, a.cache.block_size, a.device.device) == ("/m/a", 64, 32, "cuda")
    assert (b.model.path, b.cache.num_blocks, b.cache.block_size) == ("/m/b", 8, 32)


def test_an_unknown_section_or_server_key_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="serverr"):
        config.load(_write(tmp_path, "[serverr]\nport = 1\n"))
    with pytest.raises(ValidationError, match="prot"):
        config.load(_write(tmp_path, "[server]\nprot = 1\n"))
    with pytest.raises(ValueError, match=r"(?s)model .x.*block_size"):
        _, models, _ = config.load(_write(tmp_path, "[models.x.cache]\nblock_size = 3\n"))
        config.engine_config("x", models["x"])


def test_a_models_table_and_a_model_argument_together_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, '[models.a.model]\npath = "/m/a"\n')
    with pytest.raises(ValueError, match=r"\[models\] table"):
        configure(_args(config=str(path), served_model="/m/b"))
    server, engines = configure(_args(config=str(path), port=0))
    assert list(engines) == ["a"] and engines["a"].model.path == "/m/a" and server.port == 0


def test_served_model_name_names_the_one_model(tmp_path: Path, llama_ckpt: Path) -> None:
    _, engines = configure(_args(served_model=str(llama_ckpt), served_model_name="my-model"))
    assert list(engines) == ["my-model"] and engines["my-model"].model.path == str(llama_ckpt)
    _, engines = configure(_args(served_model=str(llama_ckpt)))
    assert list(engines) == [llama_ckpt.name]


def test_the_example_files_serve_block_names_every_server_field_with_its_default() -> None:
    text = EXAMPLE_TOML.read_text()
    block = text[text.index("# [server]") :]
    uncommented = "\n".join(re.sub(r"^# ?", "", line) for line in block.splitlines() if not line.startswith("# #"))
    data = tomllib.loads(uncommented)
    assert set(data["server"]) == set(ServerConfig.model_fields)
    defaults = ServerConfig()
    unset = {name for name, field in ServerConfig.model_fields.items() if field.default is None}
    for name, value in data["server"].items():
        if name not in unset:
            assert value == getattr(defaults, name), name
    assert set(data["models"]) == {"smol", "qwen"}
    assert tomllib.loads(text)  # and the file as shipped still loads (the block is all comments)
