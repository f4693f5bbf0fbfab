"""The import rules of DESIGN.md: layers only import downwards.

Checked twice: on the source (each module's own imports), and on what a fresh interpreter actually
loads when it imports a layer, so an import that reaches a forbidden module through another of ours
(or through a package ``__init__``) fails too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "aioengine"

ASYNCIO_SIDE = ("aioengine.engine", "aioengine.executor", "aioengine.cli", "aioengine.demo", "aioengine.server")
"""Our modules that run on the event loop (the executor is the bridge: it may use asyncio)."""


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only, never imported at run time)."""
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        nodes.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _files(*parts: str) -> list[Path]:
    files: list[Path] = []
    for part in parts:
        target = PACKAGE / part
        files.extend(sorted(target.rglob("*.py")) if target.is_dir() else [target])
    return files


def _module_file(module: str) -> Path:
    relative = Path(*module.split(".")[1:])
    package = PACKAGE / relative / "__init__.py"
    return package if package.is_file() else PACKAGE / relative.with_suffix(".py")


def _loaded_by(module: str) -> list[str]:
    """``sys.modules`` of a fresh interpreter after ``import module``."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded: list[str] = json.loads(result.stdout.splitlines()[-1])
    return loaded


# ---- each module's own imports -------------------------------------------------------------------------
@pytest.mark.parametrize("path", _files("worker", "model", "sampling"), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_nothing_below_the_executor_imports_asyncio(path: Path) -> None:
    assert not any(name == "asyncio" or name.startswith("asyncio.") for name in _imports(path))


@pytest.mark.parametrize(
    "path",
    _files("engine", "scheduler", "config.py", "config_sections.py", "messages.py", "errors.py"),
    ids=lambda p: p.relative_to(PACKAGE).as_posix(),
)
def test_nothing_above_the_executor_imports_torch(path: Path) -> None:
    assert not any(name == "torch" or name.startswith("torch.") for name in _imports(path))


@pytest.mark.parametrize(
    "path", _files("config.py", "config_sections.py", "messages.py", "errors.py"), ids=lambda p: p.name
)
def test_bottom_modules_import_nothing_of_ours(path: Path) -> None:
    # config.py gathers the sections of config_sections.py (one concept in two files): the bottom's one import.
    allowed = {"aioengine.config_sections"} if path.name == "config.py" else set()
    assert not {name for name in _imports(path) if name.startswith("aioengine")} - allowed


@pytest.mark.parametrize(
    "path",
    _files("worker", "model", "sampling", "scheduler", "executor"),
    ids=lambda p: p.relative_to(PACKAGE).as_posix(),
)
def test_lower_layers_never_import_the_engine(path: Path) -> None:
    assert not any(name.startswith("aioengine.engine") for name in _imports(path))


# ---- what a fresh interpreter loads ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "module",
    ["aioengine", "aioengine.messages", "aioengine.config", "aioengine.errors", "aioengine.scheduler.scheduler",
     "aioengine.sampling.params", "aioengine.engine.async_engine", "aioengine.engine.pool"],
)  # fmt: skip
def test_the_asyncio_side_and_the_bottom_load_no_torch(module: str) -> None:
    loaded = _loaded_by(module)
    assert "torch" not in loaded, f"importing {module} loads torch"


@pytest.mark.parametrize(
    "module",
    ["aioengine.worker.worker", "aioengine.worker.wrapper", "aioengine.worker.cpu_worker", "aioengine.model.llama",
     "aioengine.model.loader", "aioengine.sampling.sampler", "plugins.weight_sync", "plugins.inspect"],
)  # fmt: skip
def test_nothing_below_the_executor_loads_the_asyncio_side(module: str) -> None:
    # torch itself imports asyncio, so sys.modules alone cannot tell who asked for it. What is ours is
    # exact: no module of the asyncio side is loaded, and no module of ours that is loaded imports
    # asyncio itself.
    ours = [name for name in _loaded_by(module) if name == "aioengine" or name.startswith("aioengine.")]
    assert not [name for name in ours if name.startswith(ASYNCIO_SIDE)], f"importing {module} loads the asyncio side"
    direct = [name for name in ours if "asyncio" in _imports(_module_file(name))]
    assert not direct, f"importing {module} loads modules of ours that import asyncio: {direct}"
