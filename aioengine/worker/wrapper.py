"""WorkerWrapper: created by the executor with its rank only; builds the real worker later.

The delay exists for Ray and multi-process back ends, where the device a rank owns is only
known after the process or actor starts (seeds: WorkerWrapperBase.init_worker).
"""

from __future__ import annotations

import importlib
from typing import Any

from aioengine.errors import AIOEngineError, ConfigurationError
from aioengine.worker.base import WorkerBase


def resolve_obj_by_qualname(qualname: str | type) -> type:
    """``"package.module.Class"`` -> the class; a class is returned as it is."""
    if isinstance(qualname, type):
        return qualname
    module_name, _, attr = qualname.rpartition(".")
    if not module_name:
        raise AIOEngineError(f"{qualname!r} is not a 'module.Qualname' string")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise AIOEngineError(f"cannot import {qualname!r}: {exc}") from exc


def with_extension(worker_cls: type, extension_cls: type) -> type:
    """A NEW subclass mixing ``extension_cls`` into ``worker_cls``; neither class is modified."""
    # The extension's own names, composed mixins included, against everything the worker class has.
    clashes = sorted(
        name for name in _extension_names(extension_cls) if any(hasattr(c, name) for c in worker_cls.__mro__)
    )
    if clashes:
        raise ConfigurationError(
            f"worker extension {extension_cls.__qualname__} redefines worker attribute(s) {clashes}; rename them"
        )
    return type(f"{worker_cls.__name__}With{extension_cls.__name__}", (worker_cls, extension_cls), {})


def _extension_names(extension_cls: type) -> set[str]:
    return {
        name
        for c in extension_cls.__mro__
        if c is not object
        for name in vars(c)
        if not (name.startswith("__") and name.endswith("__"))
    }


def check_instance_clashes(worker: object, extension_cls: type) -> None:
    """An extension name that the worker sets on its instance (``device``, ``config``, ...) would be
    shadowed by it: an error at start-up, not a ``TypeError`` at the first call."""
    shadowed = sorted(_extension_names(extension_cls) & set(vars(worker)))
    if shadowed:
        raise ConfigurationError(
            f"worker extension {extension_cls.__qualname__} defines {shadowed}, which the worker sets on its "
            "instance (so the extension's would never be reached); rename them"
        )


def _auto_worker_cls(config: Any, local_rank: int) -> str | type:
    name = config.parallel.worker_cls
    if name != "auto":
        return name
    from aioengine.worker.worker import resolve_device

    if resolve_device(config.device.device, local_rank).type == "cuda":
        return "aioengine.worker.gpu_worker.CUDAWorker"
    return "aioengine.worker.cpu_worker.CPUWorker"


class WorkerWrapper:
    """Holds one rank's worker; ``__getattr__`` forwards everything else to it."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.worker: WorkerBase | None = None

    def init_worker(self, config: Any, local_rank: int = 0, distributed_init_method: str | None = None) -> None:
        worker_cls = resolve_obj_by_qualname(_auto_worker_cls(config, local_rank))
        extension = config.parallel.worker_extension_cls
        extension_cls = resolve_obj_by_qualname(extension) if extension is not None else None
        if extension_cls is not None:
            worker_cls = with_extension(worker_cls, extension_cls)
        worker = worker_cls(
            config,
            rank=self.rank,
            local_rank=local_rank,
            is_driver_worker=self.rank == 0,
            distributed_init_method=distributed_init_method,
        )
        if extension_cls is not None:
            check_instance_clashes(worker, extension_cls)
        self.worker = worker

    def __getattr__(self, name: str) -> Any:
        worker = self.__dict__.get("worker")
        if worker is None:
            raise AIOEngineError(f"worker rank {self.__dict__.get('rank')} has no worker yet (call init_worker first)")
        return getattr(worker, name)
