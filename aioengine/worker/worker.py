"""Worker: one device, its model (via ModelRunner) and its KV cache (via CacheEngine).

This class holds what every device shares; CPUWorker and CUDAWorker (cpu_worker.py,
gpu_worker.py) implement the device parts. ``parallel.worker_cls = "auto"`` picks one.
"""

from __future__ import annotations

import gc
import logging
import socket
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch

from aioengine.errors import AIOEngineError, ConfigurationError, EngineStateError, WeightsLostError
from aioengine.loopback import LOOPBACK
from aioengine.messages import (
    KVCacheConfig,
    ModelInfo,
    ModelRunnerOutput,
    SchedulerOutput,
    SleepLevel,
    TagBytes,
    WorkerSleepReport,
    WorkerWakeReport,
    WorkerWeightsReport,
    check_choice,
    check_tags,
)
from aioengine.model.parallel import SINGLE, TensorParallel, parse_init_method
from aioengine.worker.base import WorkerBase
from aioengine.worker.cache_engine import CacheEngine
from aioengine.worker.cpu_priority import run_at_priority
from aioengine.worker.model_runner import ModelRunner
from aioengine.worker.sleep import SleepBackend, create_sleep_backend
from aioengine.worker.weights import (
    SourceView,
    StagedWeights,
    WeightSource,
    apply_weights,
    describe_source,
    stage_weights,
)

logger = logging.getLogger(__name__)

CPU_WARM_UP_TOKENS = 64
"""The CPU warm-up forward's prompt length (``compile_or_warm_up_model``)."""


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> this rank's CUDA device if there is one, else the CPU."""
    if name == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigurationError(f"device.device={name!r} but CUDA is not available here; use 'cpu' or 'auto'")
    return torch.device(name)


def resolve_model_path(path: str | None) -> str:
    """The configured checkpoint, or the embedded default model when none is set: SmolLM2-135M-Instruct,
    fetched and converted once into the user cache (``aioengine.models``), or, when it cannot be had, the
    random-init demo model, with one line on stderr saying why."""
    if path is not None:
        return path
    from aioengine.models import default_model

    return str(default_model().path)


class Worker(WorkerBase):
    """Device-independent part of a worker; subclasses provide ``_bind_device`` and memory sizing."""

    def __init__(
        self,
        config: Any,
        rank: int = 0,
        local_rank: int = 0,
        is_driver_worker: bool = True,
        distributed_init_method: str | None = None,
    ) -> None:
        self.device: torch.device | None = None
        self.tp: TensorParallel = SINGLE
        self.model_runner: ModelRunner | None = None
        self.profiler: torch.profiler.profile | None = None
        self.sleep_backend: SleepBackend | None = None
        self.weights_version = 0
        """+1 per weight write on any path; every step's output carries it (this worker owns the count)."""
        self._staged: StagedWeights | None = None
        self._shut_down = False
        super().__init__(config, rank, local_rank, is_driver_worker, distributed_init_method)

    # ---- lifecycle (seeds order) ---------------------------------------------------------------------
    def init_device(self) -> None:
        self.device = resolve_device(self.config.device.device, self.local_rank)
        self._bind_device()
        torch.manual_seed(self.config.model.seed)
        self.tp = self._join_tensor_parallel(self.device)
        self.model_runner = ModelRunner(self.config, self.device, self.tp)
        self.sleep_backend = create_sleep_backend(self.config.sleep.backend, self.model_runner)

    def _bind_device(self) -> None:
        """Device-specific set-up after ``self.device`` is known."""
        raise NotImplementedError

    def _join_tensor_parallel(self, device: torch.device) -> TensorParallel:
        """This rank's tensor-parallel group (blocks until every rank joined); the single rank without one."""
        size = self.config.parallel.tensor_parallel_size
        if size == 1:
            return SINGLE
        if self.distributed_init_method is None:
            raise ConfigurationError(
                f"tensor_parallel_size={size} needs a distributed_init_method (tcp://HOST:PORT) from the executor"
            )
        timeout = timedelta(seconds=self.config.parallel.step_timeout_s)
        return TensorParallel.connect(self.rank, size, self.distributed_init_method, device, timeout, self._tp_host())

    def _tp_host(self) -> str:
        """This rank's address for the group's traffic: loopback when the ranks meet on 127.0.0.1 (one host),
        else the address of the interface that reaches the meeting host (ranks on several nodes)."""
        host, port = parse_init_method(self.distributed_init_method or "")
        if host == LOOPBACK:
            return host
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))  # UDP: picks the route, sends nothing
            return str(probe.getsockname()[0])

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
            self._runner().load_model(resolve_model_path(self.config.model.path))

    def get_model_info(self) -> ModelInfo:
        return self._runner().model_info()

    def get_cache_block_size_bytes(self) -> int:
        return self._runner().get_cache_block_size_bytes()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        with self._backend().allocation_region("kv_cache"):
            self._runner().initialize_kv_cache(kv_cache_config)

    # ---- sleep / wake --------------------------------------------------------------------------------
    def sleep(self, level: SleepLevel = 1) -> WorkerSleepReport:
        """Frees device memory (level 1: weights backed up to host; level 2: weights discarded).

        Sleeping while asleep changes nothing and says so.
        """
        check_choice("sleep level", level, SleepLevel)
        backend = self._backend()
        if backend.asleep:
            return WorkerSleepReport(TagBytes(), 0.0, (f"already asleep (level {backend.level}); nothing freed",))
        start = time.perf_counter()
        self._runner().drop_packed_weights(keep_values=level == 1)  # level 2 discards the weights
        freed, notes = backend.sleep(level)
        return WorkerSleepReport(freed, time.perf_counter() - start, tuple(notes))

    def wake_up(self, tags: Iterable[str] | None = None) -> WorkerWakeReport:
        """Restores ``tags`` (default: all); recaptures decode graphs once everything is awake."""
        wanted = check_tags(tags)
        backend = self._backend()
        runner = self._runner()
        start = time.perf_counter()
        restored = backend.wake_up(wanted)
        if "weights" not in backend.asleep and backend.weights_valid:
            runner.prepack_weights()
        capture = 0.0 if backend.asleep else runner.recapture_if_released()
        return WorkerWakeReport(restored, time.perf_counter() - start, capture, tuple(sorted(backend.asleep)))

    def is_sleeping(self) -> list[str]:
        """Tags still asleep (empty when fully awake)."""
        return sorted(self._backend().asleep)

    # ---- hot weight swap --------------------------------------------------------------------------------
    def stage_weights(
        self, source: WeightSource, partial: bool = False, allow_non_finite: bool = False
    ) -> WorkerWeightsReport:
        """Reads and checks ``source`` into host memory for the next ``update_weights(None)``.

        Runs off the step thread (Executor.run_aside) while the engine serves: it only reads the model. The reading
        itself runs at ``load.staging_priority`` (``cpu_priority.run_at_priority``).
        """
        model = self._runner().model
        assert model is not None
        start = time.perf_counter()
        self._staged = run_at_priority(
            self.config.load.staging_priority,
            lambda: stage_weights(
                model, source, strict=self.config.load.strict, partial=partial, allow_non_finite=allow_non_finite
            ),
            "aioengine-staging",
        )
        return WorkerWeightsReport(
            len(self._staged.tensors),
            self._staged.nbytes,
            time.perf_counter() - start,
            self.weights_version,
            self._backend().weights_valid,
        )

    def update_weights(
        self, source: WeightSource | None, partial: bool = False, allow_non_finite: bool = False
    ) -> WorkerWeightsReport:
        """Checks the whole source, then writes it in place (``None``: what ``stage_weights`` read)."""
        if source is None:
            if self._staged is None:
                raise EngineStateError("update_weights(None) without staged weights; call stage_weights first")
            source, self._staged = self._staged, None
        view = describe_source(source, allow_non_finite=allow_non_finite)
        return self.write_weights(view, partial=partial, allow_non_finite=allow_non_finite)

    def write_weights(
        self, source: SourceView, *, partial: bool, allow_non_finite: bool = False
    ) -> WorkerWeightsReport:
        """THE weight write of this worker, for ``update_weights`` and for extensions (weight sync).

        Checks every spec against the model (``WeightPlan``: names, shapes, dtypes, repeats, coverage
        unless ``partial``) before the source is read, then copies in place; bumps
        ``weights_version``; a full write makes discarded weights valid again; rebuilds the packed
        copies. The returned report tells the engine all of it (``EngineCore.weights_written``). A
        write that breaks after its first tensor (``WeightsLostError``) leaves the weights discarded:
        no forward runs on the mix.
        """
        backend = self._backend()
        if "weights" in backend.asleep:
            raise EngineStateError("the weights are asleep: wake_up(tags=['weights']) first, then update them")
        runner = self._runner()
        assert runner.model is not None and self.device is not None
        start = time.perf_counter()
        try:
            tensors, nbytes = apply_weights(
                runner.model,
                source,
                strict=self.config.load.strict,
                partial=partial,
                allow_non_finite=allow_non_finite,
            )
        except WeightsLostError:
            self.weights_version += 1
            backend.weights_discarded()
            runner.drop_packed_weights(keep_values=False)
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.weights_version += 1
        if not partial:
            backend.weights_loaded()
        if backend.weights_valid:
            runner.prepack_weights()
        return WorkerWeightsReport(
            tensors, nbytes, time.perf_counter() - start, self.weights_version, backend.weights_valid
        )

    def compile_or_warm_up_model(self) -> float:
        """Warm-up forward, then decode graph capture (CUDA); returns seconds, which are logged.

        On CUDA the forward is at the largest step (the allocator's pools then hold what steps need); on
        CPU a short one, enough to load every kernel: the host has no pools to fill, and a forward at the
        largest step costs seconds there."""
        start = time.perf_counter()
        runner = self._runner()
        runner.profile_run(None if runner.device.type == "cuda" else CPU_WARM_UP_TOKENS)
        capture = runner.capture_model()
        seconds = time.perf_counter() - start
        logger.info("warm-up took %.2fs (graph capture %.2fs)", seconds, capture)
        return seconds

    # ---- steps -------------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        runner, cache = self._runnable("execute_model")
        cache.swap_in(scheduler_output.blocks_to_swap_in)
        cache.swap_out(scheduler_output.blocks_to_swap_out)
        cache.copy(scheduler_output.blocks_to_copy)
        output = runner.execute_model(scheduler_output)
        if output is not None:
            output.weights_version = self.weights_version
        return output

    def sample_tokens(self) -> ModelRunnerOutput:
        output = self._runner().sample_tokens()
        output.weights_version = self.weights_version
        return output

    def execute_window(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The window in one call where the model runs it so (``ModelRunner.execute_window``). Not where a worker
        class overrides ``execute_model`` or ``sample_tokens`` (it sees every step), nor for a window that moves
        blocks: ``run_window`` runs those one step at a time."""
        own = type(self).execute_model is Worker.execute_model and type(self).sample_tokens is Worker.sample_tokens
        s = scheduler_output
        if not own or s.blocks_to_swap_in or s.blocks_to_swap_out or s.blocks_to_copy:
            return None
        runner, _ = self._runnable("execute_window")
        output = runner.execute_window(s)
        if output is not None:
            output.weights_version = self.weights_version
        return output

    def _runnable(self, call: str) -> tuple[ModelRunner, CacheEngine]:
        """The model runner and its KV cache, where a forward may run."""
        runner = self._runner()
        cache = runner.cache_engine
        if cache is None:
            raise EngineStateError(f"{call} without a KV cache (asleep, or before initialize_from_config)")
        if not self._backend().weights_valid:
            raise EngineStateError(
                "refusing to run a forward: the weights were discarded (sleep level 2); load them again first"
            )
        return runner, cache

    # ---- profiling, health, shutdown ---------------------------------------------------------------
    def profile(self, is_start: bool = True) -> str | None:
        """Starts or stops the torch profiler; the trace goes to ``profiler.dir``. Returns that dir on stop."""
        cfg = self.config.profiler
        if cfg.dir is None:
            raise RuntimeError(
                "profiling is off: set profiler.dir (e.g. AIOENGINE_PROFILER__DIR=/tmp/traces) "
                "to a directory for traces"
            )
        if is_start:
            if self.profiler is not None:
                raise RuntimeError("the profiler is already running; stop it first")
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device is not None and self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=cfg.record_shapes,
                with_stack=cfg.with_stack,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(cfg.dir, worker_name=f"rank{self.rank}"),
            )
            self.profiler.start()
            return None
        if self.profiler is None:
            raise RuntimeError("the profiler is not running; start it first")
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        return str(cfg.dir)

    def check_health(self) -> None:
        """Raises unless this worker can serve: shut down, not initialised, or a model that no longer
        computes (a tiny forward-free probe: every parameter and buffer still has its storage, unless
        asleep)."""
        if self._shut_down:
            raise AIOEngineError(f"worker rank {self.rank} is shut down")
        runner = self.model_runner
        if runner is None or runner.model is None:
            raise AIOEngineError(f"worker rank {self.rank} is not initialised (no model loaded)")
        backend = self._backend()
        if "kv_cache" not in backend.asleep and runner.cache_engine is None:
            raise AIOEngineError(f"worker rank {self.rank} is awake but has no KV cache")
        if "weights" not in backend.asleep:
            empty = [name for name, p in runner.model.named_parameters() if p.numel() == 0]
            if empty:
                raise AIOEngineError(f"worker rank {self.rank} is awake but parameters have no storage: {empty[:3]}")

    def shutdown(self) -> None:
        """Seeds order: profiler, then model runner (graphs, cache, model), then device caches. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        if self.model_runner is not None:
            self.model_runner.shutdown()
        self.tp.close()
        self.tp = SINGLE
        gc.collect()
        self._release_device_memory()

    def _release_device_memory(self) -> None:
        """Hands cached device memory back after shutdown; nothing to do on CPU."""
