"""The import rules of DESIGN.md, checked on the source: layers only import downwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "aioengine"


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


@pytest.mark.parametrize("path", _files("worker", "model", "sampling"), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_nothing_below_the_executor_imports_asyncio(path: Path) -> None:
    assert not any(name == "asyncio" or name.startswith("asyncio.") for name in _imports(path))


@pytest.mark.parametrize(
    "path", _files("engine", "scheduler", "config.py", "messages.py", "errors.py"),
    ids=lambda p: p.relative_to(PACKAGE).as_posix(),
)  # fmt: skip
def test_nothing_above_the_executor_imports_torch(path: Path) -> None:
    assert not any(name == "torch" or name.startswith("torch.") for name in _imports(path))


@pytest.mark.parametrize("path", _files("config.py", "messages.py", "errors.py"), ids=lambda p: p.name)
def test_bottom_modules_import_nothing_of_ours(path: Path) -> None:
    assert not any(name.startswith("aioengine") for name in _imports(path))


@pytest.mark.parametrize("path", _files("worker", "model", "sampling", "scheduler", "executor"),
                         ids=lambda p: p.relative_to(PACKAGE).as_posix())  # fmt: skip
def test_lower_layers_never_import_the_engine(path: Path) -> None:
    assert not any(name.startswith("aioengine.engine") for name in _imports(path))
