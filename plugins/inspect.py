"""InspectExtension: read-only views of a running worker (weights, memory, model shape).

Enable it with ``parallel.worker_extension_cls = "plugins.inspect.InspectExtension"`` and call
its methods through ``await engine.collective_rpc("memory_report")``. They run on the worker's
own thread, between model steps, and return plain data (no tensors), so they work unchanged
behind any executor.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import nn

from aioengine.errors import AIOEngineError
from aioengine.model.packing import dense_parameters

__all__ = ["InspectExtension", "tensor_checksum"]

CHECKSUM_HEX_CHARS = 16
"""Length of a checksum: 64 bits of sha256, plenty to tell weights apart, short enough to print."""


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 (shortened) of a tensor's dtype, shape and exact bytes; the device does not matter.

    Equal for bit-identical tensors in any process; any change of one element changes it.
    """
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # uint8 view: bf16 has no numpy dtype
    digest = hashlib.sha256(f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}".encode())
    digest.update(data.numpy().data)  # the array's memoryview: no copy
    return digest.hexdigest()[:CHECKSUM_HEX_CHARS]


def loaded_model(worker: Any) -> nn.Module:
    """The worker's model; a clear error before ``load_model`` or after ``shutdown``."""
    runner = getattr(worker, "model_runner", None)
    model = getattr(runner, "model", None)
    if model is None:
        raise AIOEngineError(f"worker rank {worker.rank} has no model loaded (not started yet, or shut down)")
    return model


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _module_groups(model: nn.Module) -> list[str]:
    """Top-level modules to count parameters by: ``model.embed_tokens``, ``model.layers``, ``lm_head``...

    A child that only holds other modules (the HF ``model`` wrapper) is opened one level, so the
    summary shows the parts a reader knows rather than one line per wrapper.
    """
    groups: list[str] = []
    for name, child in model.named_children():
        opens = not isinstance(child, nn.ModuleList) and not any(True for _ in child.parameters(recurse=False))
        subs = [f"{name}.{sub}" for sub, _ in child.named_children()] if opens else []
        groups.extend(subs or [name])
    return groups


def _proc_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # not Linux


class InspectExtension:
    """Worker mixin: checksums of the weights, a memory report and a model summary.

    Methods only read; they never touch the KV cache contents or the weights.
    """

    def weight_checksums(self) -> dict[str, str]:
        """``{parameter name: checksum}`` of every parameter (our fused names, e.g. ``...qkv_proj.weight``).

        Same weights give the same dict in any engine or process, so comparing dicts tells
        which parameters a weight update changed. Copies each parameter to the host once.
        """
        model = loaded_model(self)
        return {name: tensor_checksum(values) for name, values in dense_parameters(model).items()}

    def memory_report(self) -> dict[str, Any]:
        """Bytes held by this worker: weights (tied ones once), KV cache, process RSS, CUDA allocator.

        The ``cuda_*`` entries are None on CPU.
        """
        model = loaded_model(self)
        device: torch.device = self.device  # type: ignore[attr-defined]
        cache = self.model_runner.cache_engine  # type: ignore[attr-defined]
        report: dict[str, Any] = {
            "rank": self.rank,  # type: ignore[attr-defined]
            "device": str(device),
            "weights_bytes": sum(_nbytes(p) for p in model.parameters()),  # parameters() lists a tied one once
            "buffers_bytes": sum(_nbytes(b) for b in model.buffers()),
            "kv_cache_bytes": cache.nbytes if cache is not None else 0,
            "kv_cache_host_pool_bytes": sum(_nbytes(t) for t in cache.host_cache) if cache is not None else 0,
            "kv_blocks": cache.num_cache_blocks if cache is not None else 0,
            "kv_block_size": cache.block_size if cache is not None else 0,
            "process_rss_bytes": _proc_rss_bytes(),
            "cuda_allocated_bytes": None,
            "cuda_reserved_bytes": None,
            "cuda_free_bytes": None,
            "cuda_total_bytes": None,
        }
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            report.update(
                cuda_allocated_bytes=torch.cuda.memory_allocated(device),
                cuda_reserved_bytes=torch.cuda.memory_reserved(device),
                cuda_free_bytes=free,
                cuda_total_bytes=total,
            )
        return report

    def model_summary(self) -> dict[str, Any]:
        """Architecture, dtype, parameter counts (total and per top-level module), max_model_len."""
        model = loaded_model(self)
        runner = self.model_runner  # type: ignore[attr-defined]
        groups = _module_groups(model)
        per_module = dict.fromkeys(groups, 0)
        for name, param in model.named_parameters():  # a tied weight counts once, under its first owner
            owner = next((g for g in groups if name == g or name.startswith(g + ".")), name.split(".")[0])
            per_module[owner] = per_module.get(owner, 0) + param.numel()
        info = runner.model_info()
        return {
            "architecture": info.architecture,
            "dtype": info.dtype,
            "device": str(runner.device),
            "num_params": sum(per_module.values()),
            "num_layers": info.num_layers,
            "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len,
            "tie_word_embeddings": bool(getattr(model, "tie_word_embeddings", False)),
            "params_per_module": {name: count for name, count in per_module.items() if count},
        }
