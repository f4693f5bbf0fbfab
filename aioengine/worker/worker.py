"""Worker: one device, its model (via ModelRunner) and its KV cache (via CacheEngine).

This class holds what every device shares; CPUWorker and CUDAWorker (cpu_worker.py,
gpu_worker.py) implement the device parts. ``parallel.worker_cls = "auto"`` picks one.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import torch

from aioengine.errors import AIOEngineError
from aioengine.messages import KVCacheConfig, ModelRunnerOutput, SchedulerOutput
from aioengine.worker.base import WorkerBase
from aioengine.worker.model_runner import ModelRunner
from aioengine.worker.sleep import TAGS, SleepBackend, create_sleep_backend, timed
from aioengine.worker.weights import StagedWeights, WeightSource, apply_weights, stage_weights

logger = logging.getLogger(__name__)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> this rank's CUDA device if there is one, else the CPU."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise AIOEngineError(f"device.device={name!r} but CUDA is not available here; use 'cpu' or 'auto'")
    return torch.device(name)


class Worker(WorkerBase):
    """Device-independent part of a worker; subclasses provide ``_bind_device`` and memory sizing."""

    def __init__(self, config: Any, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None, is_driver_worker: bool = True) -> None:  # fmt: skip
        super().__init__(config, rank, local_rank, distributed_init_method, is_driver_worker)
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        self.profiler: torch.profiler.profile | None = None
        self.sleep_backend: SleepBackend | None = None
        self._staged: StagedWeights | None = None
        self._shut_down = False

    # ---- lifecycle (seeds order) ---------------------------------------------------------------------
    def init_device(self) -> None:
        self.device = resolve_device(self.config.device.device, self.local_rank)
        self._bind_device()
        torch.manual_seed(self.config.model.seed)
        self.model_runner = ModelRunner(self.config, self.device)
        self.sleep_backend = create_sleep_backend(self.config.sleep.backend, self.model_runner)

    def _bind_device(self) -> None:
        """Device-specific set-up after ``self.device`` is known."""
        raise NotImplementedError

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise AIOEngineError("worker used before init_device()")
        return self.model_runner

    def _backend(self) -> SleepBackend:
        if self.sleep_backend is None:
            raise AIOEngineError("worker used before init_device()")
        return self.sleep_backend

    def load_model(self) -> None:
        with self._backend().allocation_region("weights"):
            self._runner().load_model()

    def get_model_info(self) -> dict[str, Any]:
        return self._runner().model_info()

    def get_cache_block_size_bytes(self) -> int:
        return self._runner().get_cache_block_size_bytes()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        with self._backend().allocation_region("kv_cache"):
            self._runner().initialize_kv_cache(kv_cache_config)

    # ---- sleep / wake --------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Frees device memory (level 1: weights backed up to host; level 2: weights discarded).

        Returns bytes freed per tag, seconds and notes. Sleeping while asleep changes nothing and says so.
        """
        backend = self._backend()
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if backend.asleep:
            return {"freed_bytes": {"kv_cache": 0, "weights": 0}, "seconds": 0.0,
                    "notes": [f"already asleep (level {backend.level}); nothing freed"]}  # fmt: skip
        self._runner().drop_packed_weights()
        return timed(backend.sleep, level)

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        """Restores ``tags`` (default: all); recaptures decode graphs once everything is awake."""
        tags = list(TAGS) if tags is None else list(tags)
        unknown = sorted(set(tags) - set(TAGS))
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; known tags: {list(TAGS)}")
        backend = self._backend()
        report = timed(backend.wake_up, tags)
        report["graph_capture_seconds"] = 0.0
        runner = self._runner()
        if "weights" not in backend.asleep:
            runner.prepack_weights()  # a no-op while the weights are discarded (level 2, not reloaded)
        if not backend.asleep and runner.decode_runner is not None and not runner.decode_runner.graphs:
            report["graph_capture_seconds"] = runner.capture_model()
        report["asleep"] = sorted(backend.asleep)
        return report

    def is_sleeping(self) -> list[str]:
        """Tags still asleep (empty when fully awake)."""
        return sorted(self._backend().asleep)

    # ---- hot weight swap --------------------------------------------------------------------------------
    def stage_weights(self, source: WeightSource, partial: bool = False) -> dict[str, Any]:
        """Reads and checks ``source`` into host memory for the next ``update_weights(None)``.

        Runs off the step thread (Executor.run_aside) while the engine serves: it only reads the model.
        """
        model = self._runner().model
        assert model is not None
        start = time.perf_counter()
        self._staged = stage_weights(model, source, strict=self.config.load.strict, partial=partial)
        return {"tensors": len(self._staged.tensors), "bytes": self._staged.nbytes,
                "seconds": time.perf_counter() - start}  # fmt: skip

    def update_weights(self, source: WeightSource | None, partial: bool = False) -> dict[str, Any]:
        """Checks the whole source, then writes it in place (``None``: what ``stage_weights`` read)."""
        if "weights" in self._backend().asleep:
            raise AIOEngineError("wake the weights first (wake_up(tags=['weights'])), then update them")
        runner = self._runner()
        assert runner.model is not None and self.device is not None
        if source is None:
            if self._staged is None:
                raise AIOEngineError("update_weights(None) without staged weights; call stage_weights first")
            source, self._staged = self._staged, None
        start = time.perf_counter()
        report = apply_weights(runner.model, source, strict=self.config.load.strict, partial=partial,
                               rank=self.rank, world_size=self.config.parallel.tensor_parallel_size)  # fmt: skip
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not partial:
            runner.weights_ready = True
        runner.prepack_weights()
        report["seconds"] = time.perf_counter() - start
        return report

    def compile_or_warm_up_model(self) -> float:
        """Warm-up forward, then decode graph capture (CUDA); returns seconds, which are logged."""
        start = time.perf_counter()
        runner = self._runner()
        runner.profile_run()
        capture = runner.capture_model()
        seconds = time.perf_counter() - start
        logger.info("warm-up took %.2fs (graph capture %.2fs)", seconds, capture)
        return seconds

    # ---- steps -------------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        runner = self._runner()
        cache = runner.cache_engine
        if cache is None:
            raise AIOEngineError("execute_model before initialize_from_config (the KV cache is not allocated)")
        cache.swap_in(scheduler_output.blocks_to_swap_in)
        cache.swap_out(scheduler_output.blocks_to_swap_out)
        cache.copy(scheduler_output.blocks_to_copy)
        return runner.execute_model(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        return self._runner().sample_tokens()

    # ---- profiling, health, shutdown ---------------------------------------------------------------
    def profile(self, is_start: bool = True) -> str | None:
        """Starts or stops the torch profiler; the trace goes to ``profiler.dir``. Returns that dir on stop."""
        cfg = self.config.profiler
        if cfg.dir is None:
            raise RuntimeError(
                "profiling is off: set profiler.dir (e.g. AIOENGINE_PROFILER__DIR=/tmp/traces) to a directory for traces"
            )
        if is_start:
            if self.profiler is not None:
                raise RuntimeError("the profiler is already running; stop it first")
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device is not None and self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities, record_shapes=cfg.record_shapes, with_stack=cfg.with_stack,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(cfg.dir, worker_name=f"rank{self.rank}"),
            )  # fmt: skip
            self.profiler.start()
            return None
        if self.profiler is None:
            raise RuntimeError("the profiler is not running; start it first")
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        return str(cfg.dir)

    def check_health(self) -> None:
        if self._shut_down:
            raise AIOEngineError(f"worker rank {self.rank} is shut down")
        runner = self.model_runner
        if runner is None or runner.model is None or runner.cache_engine is None:
            raise AIOEngineError(f"worker rank {self.rank} is not initialised (model or KV cache missing)")

    def shutdown(self) -> None:
        """Seeds order: profiler, then model runner (graphs, cache, model), then device caches. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        runner = self.model_runner
        if runner is not None:
            if runner.decode_runner is not None:
                runner.decode_runner.release()
                runner.decode_runner = None
            runner.cache_engine = None
            runner.model = None
        gc.collect()
        self._release_device_memory()

    def _release_device_memory(self) -> None:
        """Hands cached device memory back after shutdown; nothing to do on CPU."""
