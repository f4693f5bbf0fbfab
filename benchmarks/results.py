"""What a throughput run measures: small immutable records that ``report.py`` turns into a table,
JSON and a plot. Seconds everywhere; None where a system or measurement was not available."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def median(runs: list[T], key: Callable[[T], float]) -> T:
    """The run in the middle by ``key`` (the slower of the middle two for an even count)."""
    return sorted(runs, key=key)[len(runs) // 2]


def spread_note(rates: list[float]) -> str | None:
    """How the tokens/s of a system's repeats spread, for its note; None for a single run."""
    if len(rates) < 2:
        return None
    return f"median of {len(rates)} runs ({min(rates):.0f}-{max(rates):.0f} tok/s)"


@dataclass(frozen=True, slots=True)
class SystemResult:
    """Offline throughput of one system over the whole workload."""

    name: str
    tokens_per_s: float | None
    seconds: float | None
    note: str = ""
    others_load: float | None = None
    """Cores the rest of the machine kept busy meanwhile (cpu_load.py): high means a noisy number."""
    startup_seconds: float | None = None
    """From start to ready for the first request (engine construction, loading); None where not measured."""


@dataclass(frozen=True, slots=True)
class Floors:
    """The engine's own work, replayed on the worker for the steps the offline run executed."""

    num_steps: int
    num_forwards: int
    """The steps' forwards: a decode window runs one per step of it."""
    num_prefill_steps: int
    """Steps with at least one prompt chunk (the rest are decode-only)."""
    replay_seconds: float
    """execute_model + sample_tokens of every recorded step, timed inside the worker."""
    replay_prefill_seconds: float
    gemm_seconds: float
    """x @ W.T of every Linear (lm_head at the step's sample count), same steps, same thread."""
    others_load: float | None = None


@dataclass(frozen=True, slots=True)
class OnlineResult:
    """Poisson arrivals at one rate."""

    rate: float
    """Requests per second."""
    fraction: float
    """The rate as a share of the offline throughput in requests per second."""
    num_requests: int
    tokens_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    loop_lag_p99: float | None
    others_load: float | None = None
