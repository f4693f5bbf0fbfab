"""The model runner's KV cache and the decode runner that reads it (CUDA graphs on a GPU): allocated from the
engine's ``KVCacheConfig``, released for sleep and restored on wake, the graphs captured again where the wake moved
the cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from aioengine.messages import KVCacheConfig, ModelInfo
from aioengine.model.llama import LlamaForCausalLM
from aioengine.model.parallel import TensorParallel
from aioengine.worker.cache_engine import CacheEngine
from aioengine.worker.graphs import PaddedDecodeRunner, default_capture_sizes


class RunnerCache:
    """Mixed into ``ModelRunner``, whose ``__init__`` sets these attributes."""

    config: Any
    device: torch.device
    tp: TensorParallel
    model: LlamaForCausalLM | None
    dtype: torch.dtype
    kv_heads: int
    block_size: int
    max_model_len: int
    decode_kernel: Callable[..., None] | None
    cache_engine: CacheEngine | None
    decode_runner: PaddedDecodeRunner | None
    kv_cache_config: KVCacheConfig | None
    info: ModelInfo | None

    def model_info(self) -> ModelInfo:
        """Facts the engine needs to size the cache and validate requests (plain, picklable)."""
        if self.info is None:
            raise RuntimeError("model_info() before load_model()")
        return self.info

    def cache_dtype(self) -> torch.dtype:
        name = self.config.cache.cache_dtype
        return self.dtype if name == "auto" else getattr(torch, name)

    def get_cache_block_size_bytes(self) -> int:
        info = self.model_info()
        return CacheEngine.get_cache_block_size(
            info.num_layers, self.block_size, self.kv_heads, info.head_size, self.cache_dtype()
        )

    def release_kv_cache(self) -> int:
        """Frees the KV cache (and the decode runner whose buffers and graphs point into it); returns
        the bytes it held. ``restore_kv_cache`` brings both back."""
        if self.cache_engine is None:
            return 0
        freed = self.cache_engine.nbytes
        if self.decode_runner is not None:
            self.decode_runner.release()
            self.decode_runner = None
        self.cache_engine = None
        return freed

    def restore_kv_cache(self) -> int:
        """Allocates the KV cache again with the configuration it had; returns its bytes."""
        assert self.kv_cache_config is not None, "restore_kv_cache before initialize_kv_cache"
        self.initialize_kv_cache(self.kv_cache_config)
        assert self.cache_engine is not None
        return self.cache_engine.nbytes

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config
        info = self.model_info()
        self.cache_engine = CacheEngine(
            info.num_layers,
            self.kv_heads,
            info.head_size,
            kv_cache_config.block_size,
            kv_cache_config.num_cache_blocks,
            self.cache_dtype(),
            self.device,
            kv_cache_config.num_host_blocks,
        )
        compile_cfg = self.config.compile
        if not compile_cfg.enforce_eager:
            assert self.model is not None
            sizes = compile_cfg.cuda_graph_sizes or default_capture_sizes(self.config.scheduler.max_num_seqs)
            self.decode_runner = PaddedDecodeRunner(
                self.model,
                self.cache_engine.device_cache,
                sizes,
                self.block_size,
                -(-self.max_model_len // self.block_size),
                self.device,
                # Not under tensor parallelism yet: the collectives' capture (NCCL in a graph) is not wired up.
                use_graphs=self.device.type == "cuda" and self.tp.size == 1,
                decode_kernel=self.decode_kernel,
            )

    def capture_model(self) -> float:
        """Captures the decode CUDA graphs (no-op on CPU or with enforce_eager); returns seconds."""
        return self.decode_runner.capture() if self.decode_runner is not None else 0.0

    def recapture_if_released(self) -> float:
        """After a wake that reallocated the KV cache: captures the decode graphs again where they are
        used and missing (a no-op when graphs survived, on CPU, or with enforce_eager); returns seconds."""
        runner = self.decode_runner
        if runner is None or not runner.use_graphs or runner.graphs:
            return 0.0
        return runner.capture()
