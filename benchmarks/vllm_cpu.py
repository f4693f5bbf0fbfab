"""vLLM's official CPU engine beside aioengine: same checkpoint, same workload, named settings.

vLLM pins its own torch and transformers, so it lives in a venv of its own (the install recipe is in
benchmarks/README.md) and runs as a subprocess: ``vllm_driver.py`` under that venv's python. Which
python comes from ``--vllm-python PATH`` or ``AIOENGINE_VLLM_PYTHON``; with neither, vLLM is skipped.

Settings (``SETTINGS``), each a driver process of its own, every one float32, greedy, EOS ignored,
with the engine's scheduler limits (``max_num_seqs``, ``max_num_batched_tokens``) and vLLM's default
``torch.compile`` (inductor; ``enforce_eager`` measured slower, see benchmarks/README.md):

- "out of the box": only ``VLLM_CPU_KVCACHE_SPACE`` (which vLLM needs to start). vLLM then reserves a
  core for its engine-core process and binds the worker's OpenMP threads to the rest: one core here.
- "documented": vLLM's CPU install page: ``VLLM_CPU_OMP_THREADS_BIND`` over every core this process
  may use, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, and tcmalloc plus Intel OpenMP in ``LD_PRELOAD``.
- "best": documented plus ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core and model in the
  driver's own process). The fastest of what was tried; benchmarks/README.md says what else was.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from benchmarks.ceiling import ModelShape
from benchmarks.results import SystemResult, median, spread_note
from benchmarks.workload import BenchRequest

DRIVER = Path(__file__).with_name("vllm_driver.py")
PYTHON_ENV = "AIOENGINE_VLLM_PYTHON"
SETTINGS = ("documented", "out of the box", "best")
STARTUP_TIMEOUT = 900.0
"""Seconds a driver may take to load, allocate its KV cache and warm up (about 70 on 2 cores)."""
RUN_TIMEOUT = 900.0

TCMALLOC_GLOBS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so*",
    "/usr/lib64/libtcmalloc_minimal.so*",
    "/usr/lib/libtcmalloc_minimal.so*",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so*",
    "/usr/lib64/libtcmalloc.so*",
)
"""Where Debian's libtcmalloc-minimal4 (and the like elsewhere) puts tcmalloc."""


def vllm_python(flag: str | Path | None) -> Path | None:
    """The vLLM venv's python: the flag, else ``AIOENGINE_VLLM_PYTHON``, else None (vLLM skipped)."""
    chosen = flag or os.environ.get(PYTHON_ENV)
    return Path(chosen) if chosen else None


@dataclass(frozen=True, slots=True)
class Preloads:
    """The libraries vLLM's CPU docs ask to ``LD_PRELOAD``, where they were found."""

    tcmalloc: str | None
    iomp: str | None

    @property
    def paths(self) -> list[str]:
        return [p for p in (self.tcmalloc, self.iomp) if p]

    def describe(self) -> str:
        names = {"tcmalloc": self.tcmalloc, "libiomp5": self.iomp}
        return ", ".join(f"{name} {'found' if path else 'not found'}" for name, path in names.items())


def _first(patterns: list[str]) -> str | None:
    for pattern in patterns:
        # The shortest name first: libx.so.4 over libx.so.4.5.10 and libx_debug.so.4.
        found = sorted((p for p in glob.glob(pattern) if "debug" not in p), key=len)
        if found:
            return found[0]
    return None


def find_preloads(python: Path) -> Preloads:
    """tcmalloc from the OS; libiomp5 from the intel-openmp wheel in the venv (its ``lib/``)."""
    venv = python.parent.parent
    iomp = [str(venv / "lib" / "libiomp5.so"), str(venv / "lib" / "python3*" / "site-packages" / "**" / "libiomp5.so")]
    tcmalloc = [*TCMALLOC_GLOBS, str(venv / "lib" / "python3*" / "site-packages" / "vllm" / "libs" / "libtcmalloc*")]
    return Preloads(tcmalloc=_first(tcmalloc), iomp=_first(iomp))


def cpu_list(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` wants it: "0-2,5"."""
    parts, ids = [], sorted(cpus)
    start = prev = ids[0]
    for cpu in [*ids[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)


def kv_cache_gib(shape: ModelShape, reqs: list[BenchRequest], block_size: int = 128) -> int:
    """Whole GiB of KV cache for every request at once in vLLM's CPU blocks of 128 tokens, with half again
    as slack; at least 1. ``VLLM_CPU_KVCACHE_SPACE`` takes GiB, and every setting allocates it whole."""
    tokens = sum(-(-(len(r.prompt) + r.max_tokens) // block_size) * block_size for r in reqs)
    return max(1, math.ceil(1.5 * tokens * shape.kv_bytes_per_token() / 2**30))


def setting_env(name: str, cpus: set[int], preloads: Preloads, kv_gib: int) -> dict[str, str]:
    """The environment variables ``name`` sets on top of the inherited ones."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    if name == "out of the box":
        return env
    env |= {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    if preloads.paths:
        env["LD_PRELOAD"] = ":".join(preloads.paths)
    if name == "documented":
        return env
    if name == "best":
        return env | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    raise ValueError(f"unknown vLLM setting {name!r}: choose from {', '.join(SETTINGS)}")


def driver_spec(
    path: Path, reqs: list[BenchRequest], max_num_seqs: int, max_batched_tokens: int, seed: int = 0
) -> dict[str, Any]:
    """What ``vllm_driver.py`` reads: the checkpoint, the requests, and ``vllm.LLM``'s arguments."""
    longest = max(len(r.prompt) + r.max_tokens for r in reqs)
    return {
        "model": str(path),
        "prompts": [r.prompt for r in reqs],
        "max_tokens": [r.max_tokens for r in reqs],
        "seed": seed,
        "llm": {
            "enforce_eager": False,  # vLLM's default: the model compiled by inductor at start-up
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_batched_tokens,
            "max_model_len": max(longest, max_batched_tokens),
            # Every repeat sends the same prompts: a prefix cache would serve the later ones from the first's KV.
            "enable_prefix_caching": False,
        },
    }


@dataclass(slots=True)
class VllmRun:
    """One setting's driver process, kept alive in ``--serve`` mode so its timed runs can alternate
    with aioengine's: ``start()`` (start-up, warm-up), then ``run()`` per repeat, then ``close()``.

    Between its runs the driver's process group is stopped (SIGSTOP, SIGCONT for the next run): an idle
    vLLM still polls, 0.07 cores in process and 0.2 with its engine-core and worker processes, which
    would be taken from whoever runs meanwhile on a 2-core machine."""

    setting: str
    python: Path
    spec_path: Path
    env: dict[str, str]
    log_path: Path
    preloads: Preloads
    startup_seconds: float | None = None
    """``vllm.LLM(...)`` alone, as the driver timed it (its ``import vllm`` is apart, in ``ready``)."""
    wall_to_ready: float | None = None
    """From the driver's exec to its ready line: python, imports, start-up and warm-up."""
    ready: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None
    _buffer: bytes = b""

    @property
    def name(self) -> str:
        return f"vLLM CPU, {self.setting}"

    def start(self) -> bool:
        """Starts the driver and waits for its ready line; False (and ``error``) if it did not come."""
        self._log = self.log_path.open("wb")
        started = time.perf_counter()
        self._proc = subprocess.Popen(
            [str(self.python), str(DRIVER), str(self.spec_path), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,  # its own process group: a signal reaches vLLM's child processes too
            env={**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr", **self.env},
        )
        line = self._read_line(STARTUP_TIMEOUT)
        if line is None or line.get("event") != "ready":
            self._fail("did not start")
            return False
        self.ready = line
        self.startup_seconds = line["startup_seconds"]
        self.wall_to_ready = time.perf_counter() - started
        self._signal(signal.SIGSTOP)
        return True

    def _signal(self, sig: signal.Signals) -> None:
        """``sig`` to the driver and its children (its own process group)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, sig)

    def run(self) -> dict[str, Any] | None:
        """One timed generate over every request; None (and ``error``) if it failed."""
        if self._proc is None or self.error is not None or self._proc.stdin is None:
            return None
        self._signal(signal.SIGCONT)
        try:
            self._proc.stdin.write(b"run\n")
            self._proc.stdin.flush()
        except OSError:
            self._fail("exited")
            return None
        line = self._read_line(RUN_TIMEOUT)
        self._signal(signal.SIGSTOP)
        if line is None or line.get("event") != "run":
            self._fail("failed during a run")
            return None
        self.runs.append(line)
        return line

    def close(self) -> None:
        """Ends the driver (EOF on its stdin), killing it if it does not exit."""
        if self._proc is not None:
            self._signal(signal.SIGCONT)
            try:
                if self._proc.stdin is not None:
                    self._proc.stdin.close()
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._signal(signal.SIGKILL)
                self._proc.wait()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _read_line(self, timeout: float) -> dict[str, Any] | None:
        """The driver's next JSON line on stdout, None on EOF or after ``timeout`` seconds."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            parsed: dict[str, Any] = json.loads(line)
        except ValueError:
            return self._read_line(max(0.0, deadline - time.monotonic()))  # not ours: skip it
        return parsed

    def _fail(self, what: str) -> None:
        tail = ""
        if self._log is not None:
            self._log.flush()
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
            tail = lines[-1][-200:] if lines else ""
        self.error = f"{what} (log {self.log_path}: {tail})"
        self.close()

    def describe(self) -> dict[str, Any]:
        """Everything about this setting for the JSON file: its environment, preloads, start-up, runs."""
        return {
            "name": self.name,
            "setting": self.setting,
            "env": self.env,
            "preloads": {"tcmalloc": self.preloads.tcmalloc, "libiomp5": self.preloads.iomp},
            "startup_seconds": self.startup_seconds,
            "wall_to_ready_seconds": self.wall_to_ready,
            "ready": self.ready,
            "runs": self.runs,
            "error": self.error,
            "log": str(self.log_path),
        }

    def result(self) -> SystemResult:
        """The median run (by seconds) as a row of the systems table."""
        if not self.runs:
            return SystemResult(self.name, None, None, f"not available: {self.error}", startup_seconds=None)
        chosen = median(self.runs, lambda r: r["seconds"])
        notes = [self.preloads.describe() if "LD_PRELOAD" in self.env else "no preloads"]
        if short := chosen["short"]:
            notes.append(f"{short} requests got a different token count")
        if spread := spread_note([r["tokens_per_s"] for r in self.runs]):
            notes.append(spread)
        if self.error:
            notes.append(self.error)
        return SystemResult(
            self.name,
            chosen["tokens_per_s"],
            chosen["seconds"],
            "; ".join(notes),
            chosen.get("others_load"),
            startup_seconds=self.startup_seconds,
        )


def prepare(
    python: Path,
    path: Path,
    reqs: list[BenchRequest],
    settings: list[str],
    max_num_seqs: int,
    max_batched_tokens: int,
    log_dir: Path,
) -> list[VllmRun]:
    """One not yet started ``VllmRun`` per setting, sharing one spec file (beside their logs in ``log_dir``)."""
    shape = ModelShape.from_config(path)
    log_dir.mkdir(parents=True, exist_ok=True)
    spec_path = log_dir / "vllm_spec.json"
    spec_path.write_text(json.dumps(driver_spec(path, reqs, max_num_seqs, max_batched_tokens)))
    preloads = find_preloads(python)
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    kv_gib = kv_cache_gib(shape, reqs)
    return [
        VllmRun(
            setting=s,
            python=python,
            spec_path=spec_path,
            env=setting_env(s, cpus, preloads, kv_gib),
            log_path=log_dir / f"vllm_{s.replace(' ', '_')}.log",
            preloads=preloads,
        )
        for s in settings
    ]


def pair_ratios(aioengine_rates: list[float], runs: list[dict[str, Any]]) -> list[float]:
    """aioengine's tokens/s over vLLM's, repeat by repeat (each vLLM run came right after that repeat)."""
    return [a / r["tokens_per_s"] for a, r in zip(aioengine_rates, runs, strict=False) if r["tokens_per_s"]]


def check_python(python: Path) -> str | None:
    """None if ``python`` imports vllm; otherwise what went wrong, for the report."""
    if not python.exists():
        return f"{python} does not exist"
    try:
        done = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} did not run ({exc})"
    if done.returncode != 0:
        return f"{python} has no vllm-cpu installed"
    return None


def main(argv: list[str] | None = None) -> None:
    """A vLLM-only smoke run: ``python -m benchmarks.vllm_cpu PYTHON [requests] [settings] [model]``."""
    from benchmarks.workload import checkpoint, vocab_size, workload

    args = sys.argv[1:] if argv is None else argv
    python = Path(args[0])
    num, settings = int(args[1]) if len(args) > 1 else 8, args[2].split(",") if len(args) > 2 else list(SETTINGS)
    model = args[3] if len(args) > 3 else "tiny"
    path = checkpoint(model)
    reqs = workload(num, vocab_size(model))
    for vllm in prepare(python, path, reqs, settings, 64, 512, Path("bench_out")):
        if vllm.start():
            vllm.run()
        vllm.close()
        print(vllm.result(), vllm.ready.get("startup_seconds"))


if __name__ == "__main__":
    main()
