"""Sleep backends: give a worker's device memory back and take it again (seeds: SleepModeBackendFactory).

- ``portable``: frees storages and allocates them again on wake. Addresses change, so captured
  CUDA graphs are released on sleep and recaptured on wake (the time is reported).
- ``torch_memory_saver`` (CUDA, when the package is installed): pauses the memory regions the
  weights and the KV cache were allocated in, keeping their virtual addresses, so graphs stay valid.

Level 1 keeps a host copy of the weights (pinned on CUDA); level 2 keeps none (the engine must load
weights again before serving) but saves the model's buffers, restored by name with ``copy_``.
On a CPU device the weights already live in host memory, so level 1 frees the KV cache only.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from aioengine.errors import ConfigurationError
from aioengine.messages import WAKE_TAGS, SleepLevel, TagBytes, WakeTag

if TYPE_CHECKING:
    from aioengine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def release_host_memory() -> None:
    """Collects garbage and asks glibc to return freed heap pages to the OS (resident memory drops)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _set_buffer(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, tensor)


class SleepBackend(ABC):
    """How one worker frees and restores its device memory, and the one record of what is asleep.

    ``asleep`` (the tags whose memory is freed), ``level`` and ``weights_valid`` live here only; the
    worker and the runner ask. The engine keeps its own view of the same facts, taken from the
    reports these calls return (its ``MemoryState``).
    """

    name = "abstract"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.level: SleepLevel | None = None
        self.asleep: set[WakeTag] = set()
        self.weights_valid = True
        """False from a level-2 sleep until a full weight write (reload or update) fills them again."""

    def weights_loaded(self) -> None:
        """Every parameter was written (a full reload or update): the weights may serve again."""
        self.weights_valid = True

    def weights_discarded(self) -> None:
        """A write broke half-way: the weights are a mix and must not serve until a full write."""
        self.weights_valid = False

    @contextlib.contextmanager
    def allocation_region(self, tag: str) -> Iterator[None]:
        """Context that allocations of ``tag`` (weights / kv_cache) are made in; used at load time."""
        yield

    @abstractmethod
    def sleep(self, level: SleepLevel) -> tuple[TagBytes, list[str]]:
        """Frees memory; returns the bytes freed per tag and notes for the caller."""

    @abstractmethod
    def wake_up(self, tags: tuple[WakeTag, ...]) -> TagBytes:
        """Restores the given tags (those asleep); returns the bytes restored per tag."""


class PortableSleepBackend(SleepBackend):
    """Frees and reallocates storages; works on every device."""

    name = "portable"

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        self._weights_backup: dict[str, torch.Tensor] = {}
        self._saved_buffers: dict[str, torch.Tensor] = {}
        self._param_specs: dict[str, tuple[torch.Size, torch.dtype]] = {}

    def sleep(self, level: SleepLevel) -> tuple[TagBytes, list[str]]:
        runner = self.runner
        model = runner.model
        assert model is not None
        on_cpu = runner.device.type == "cpu"
        kv_bytes = runner.release_kv_cache()
        weight_bytes = 0
        notes = []
        if level == 1 and on_cpu:
            notes.append("level 1 on a CPU device frees the KV cache only: the weights already live in host memory")
        elif level == 1:
            pin = torch.cuda.is_available()
            for name, param in model.named_parameters():
                self._weights_backup[name] = param.data.to("cpu").pin_memory() if pin else param.data.to("cpu")
                weight_bytes += param.data.nbytes
                param.data = torch.empty(0, dtype=param.dtype, device=runner.device)
        else:
            self._saved_buffers = {name: buf.detach().to("cpu", copy=True) for name, buf in model.named_buffers()}
            for name, buf in model.named_buffers():
                _set_buffer(model, name, torch.empty(0, dtype=buf.dtype, device=runner.device))
            for name, param in model.named_parameters():
                self._param_specs[name] = (param.shape, param.dtype)
                weight_bytes += param.data.nbytes
                param.data = torch.empty(0, dtype=param.dtype, device=runner.device)
            self.weights_valid = False
            notes.append("level 2 discarded the weights: load them again (reload_weights / update_weights)")
        self.level = level
        self.asleep = set(WAKE_TAGS) if (level == 2 or not on_cpu) else {"kv_cache"}
        _empty_device_cache(runner.device)
        return TagBytes(weights=weight_bytes, kv_cache=kv_bytes), notes

    def wake_up(self, tags: tuple[WakeTag, ...]) -> TagBytes:
        runner = self.runner
        model = runner.model
        assert model is not None
        weight_bytes = kv_bytes = 0
        if "weights" in tags and "weights" in self.asleep:
            params = dict(model.named_parameters())
            if self.level == 1:
                for name, backup in self._weights_backup.items():
                    params[name].data = backup.to(runner.device, non_blocking=True)
                    weight_bytes += backup.nbytes
                self._weights_backup.clear()
            else:
                for name, (shape, dtype) in self._param_specs.items():
                    params[name].data = torch.empty(shape, dtype=dtype, device=runner.device)
                    weight_bytes += params[name].data.nbytes
                for name, saved in self._saved_buffers.items():
                    fresh = torch.empty_like(saved, device=runner.device)
                    fresh.copy_(saved)  # seeds: buffers come back by name with copy_
                    _set_buffer(model, name, fresh)
                self._param_specs.clear()
                self._saved_buffers.clear()
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            kv_bytes = runner.restore_kv_cache()
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.level = None
        return TagBytes(weights=weight_bytes, kv_cache=kv_bytes)


class TorchMemorySaverBackend(SleepBackend):
    """CUDA virtual-memory backend: pauses/resumes tagged regions; addresses (and graphs) survive."""

    name = "torch_memory_saver"

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        from torch_memory_saver import torch_memory_saver  # optional dependency

        self.saver = torch_memory_saver
        self._saved_buffers: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def allocation_region(self, tag: str) -> Iterator[None]:
        with self.saver.region(tag=tag, enable_cpu_backup=(tag == "weights")):
            yield

    def sleep(self, level: SleepLevel) -> tuple[TagBytes, list[str]]:
        runner = self.runner
        kv_bytes = runner.cache_engine.nbytes if runner.cache_engine is not None else 0
        model = runner.model
        assert model is not None
        weight_bytes = sum(p.data.nbytes for p in model.parameters())
        if level == 2:
            self._saved_buffers = {name: buf.detach().to("cpu", copy=True) for name, buf in model.named_buffers()}
            self.weights_valid = False
        self.saver.pause("kv_cache")
        self.saver.pause("weights")
        self.level = level
        self.asleep = set(WAKE_TAGS)
        return TagBytes(weights=weight_bytes, kv_cache=kv_bytes), []

    def wake_up(self, tags: tuple[WakeTag, ...]) -> TagBytes:
        model = self.runner.model
        assert model is not None
        woken = [tag for tag in WAKE_TAGS if tag in tags and tag in self.asleep]
        for tag in woken:
            self.saver.resume(tag)
            self.asleep.discard(tag)
        weight_bytes = kv_bytes = 0
        if "weights" in woken:
            buffers = dict(model.named_buffers())
            for name, saved in self._saved_buffers.items():
                buffers[name].copy_(saved)
            self._saved_buffers.clear()
            weight_bytes = sum(p.data.nbytes for p in model.parameters())
        if "kv_cache" in woken and self.runner.cache_engine is not None:
            kv_bytes = self.runner.cache_engine.nbytes
        if not self.asleep:
            self.level = None
        return TagBytes(weights=weight_bytes, kv_cache=kv_bytes)


SLEEP_BACKENDS: dict[str, type[SleepBackend]] = {
    PortableSleepBackend.name: PortableSleepBackend,
    TorchMemorySaverBackend.name: TorchMemorySaverBackend,
}


def create_sleep_backend(name: str, runner: ModelRunner) -> SleepBackend:
    """``auto``: torch_memory_saver on CUDA when installed, else portable."""
    if name == "auto":
        name = "portable"
        if runner.device.type == "cuda":
            try:
                import torch_memory_saver  # noqa: F401

                name = TorchMemorySaverBackend.name
            except ImportError:
                pass
    if name not in SLEEP_BACKENDS:
        raise ConfigurationError(f"sleep.backend {name!r} is unknown; choose one of: auto, {', '.join(SLEEP_BACKENDS)}")
    if name == TorchMemorySaverBackend.name and runner.device.type != "cuda":
        raise ConfigurationError("sleep.backend 'torch_memory_saver' needs a CUDA device; use 'portable' on CPU")
    return SLEEP_BACKENDS[name](runner)


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    else:
        release_host_memory()
