"""Prometheus metrics of the server: what ``GET /metrics`` reports, and where each number comes from.

Every series but the pool's is labelled ``model_name`` (the pool's name of the engine); names follow
vLLM's, with ``aioengine:`` for its ``vllm:``. Counters get prometheus_client's ``_total`` suffix.

Read from the engines at scrape time, so that no state is copied here (``_PoolCollector``):

- ``AsyncEngine.stats()`` of each engine of the pool: ``num_requests_running`` and ``num_requests_waiting``
  (the scheduler's queues); ``kv_blocks_free`` and ``kv_blocks_total`` (blocks requests can hold) and
  ``kv_cache_usage_perc`` = 1 - free / total, 0 unless the engine is awake; the counters
  ``prefix_cache_queries`` and ``prefix_cache_hits`` (prompt tokens that looked the prefix cache up, and those
  whose KV it held), ``num_preemptions`` and ``num_swapped_out`` (the preemptions that moved KV to the host
  instead of recomputing it), ``num_revoked_steps`` (queued steps a control call or RPC took back before
  they ran); ``weights_version`` (+1 per weight write).
- ``AsyncEngine.is_awake``: ``is_sleeping`` is 1 when it is not (asleep, but also not started or dead).
- ``EnginePool.num_switches``: ``pool_switches``, the wake-ups the pool made to serve a sleeping model.

Observed by the server, one ``RequestTracker`` per request (``ServerMetrics.track`` when it is accepted):
``time_to_first_token_seconds``, ``inter_token_latency_seconds`` and ``e2e_request_latency_seconds`` are
measured where the server reads the engine's stream, so they include the wait for a sleeping model to wake
and the queueing; ``prompt_tokens`` and ``generation_tokens`` are what the server reports to the client;
``request_success`` counts requests by ``finished_reason`` ("stop" | "length" | "abort").

Each ``ServerMetrics`` has its own registry: several servers (or tests) in one process never share series.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from aioengine.engine.async_engine import AsyncEngine
    from aioengine.engine.pool import EnginePool
    from aioengine.engine.stats import EngineStats

# vLLM's buckets (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort")
"""The ``finished_reason`` label values every model's ``request_success`` series starts with, at 0."""


class _EngineSeries(NamedTuple):
    """One series read from each engine at scrape time."""

    name: str
    documentation: str
    counter: bool
    value: Callable[[AsyncEngine, EngineStats], float]


def _kv_cache_usage(engine: AsyncEngine, stats: EngineStats) -> float:
    """Fraction of the KV blocks requests hold; 0 unless awake (asleep, the cache is not there to fill)."""
    if not engine.is_awake or stats.kv_blocks_total == 0:
        return 0.0
    return 1.0 - stats.kv_blocks_free / stats.kv_blocks_total


_ENGINE_SERIES = (
    _EngineSeries("num_requests_running", "Requests the scheduler is running.", False,
                  lambda _, s: s.requests_running),
    _EngineSeries("num_requests_waiting", "Requests waiting to be scheduled.", False, lambda _, s: s.requests_waiting),
    _EngineSeries("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", False, _kv_cache_usage),
    _EngineSeries("kv_blocks_free", "KV-cache blocks no request holds.", False, lambda _, s: s.kv_blocks_free),
    _EngineSeries("kv_blocks_total", "KV-cache blocks requests can hold.", False, lambda _, s: s.kv_blocks_total),
    _EngineSeries("prefix_cache_queries", "Prompt tokens that looked up the prefix cache.", True,
                  lambda _, s: s.prefix_cache_queries),
    _EngineSeries("prefix_cache_hits", "Prompt tokens whose KV the prefix cache held.", True,
                  lambda _, s: s.prefix_cache_hits),
    _EngineSeries("num_preemptions", "Preemptions of running requests.", True, lambda _, s: s.num_preemptions),
    _EngineSeries("num_swapped_out", "Preemptions that moved the request's KV to the host pool.", True,
                  lambda _, s: s.num_swapped_out),
    _EngineSeries("num_revoked_steps", "Queued steps a control call or RPC took back before they ran.", True,
                  lambda _, s: s.num_revoked_steps),
    _EngineSeries("is_sleeping", "1 unless the engine is started, alive and awake.", False,
                  lambda e, _: 0.0 if e.is_awake else 1.0),
    _EngineSeries("weights_version", "Weight writes the engine has made (+1 each).", False,
                  lambda _, s: s.weights_version),
)  # fmt: skip


class _PoolCollector:
    """Reads the pool's engines each scrape; nothing is stored between scrapes."""

    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        families: list[GaugeMetricFamily | CounterMetricFamily] = [
            (CounterMetricFamily if series.counter else GaugeMetricFamily)(
                f"aioengine:{series.name}", series.documentation, labels=["model_name"]
            )
            for series in _ENGINE_SERIES
        ]
        for name, tenant in self._pool.tenants.items():
            stats = tenant.engine.stats()  # not started, dead or asleep, it still answers
            for family, series in zip(families, _ENGINE_SERIES, strict=True):
                family.add_metric([name], series.value(tenant.engine, stats))
        yield from families
        switches = CounterMetricFamily("aioengine:pool_switches", "Wake-ups of a sleeping model to serve it.")
        switches.add_metric([], self._pool.num_switches)
        yield switches


class _ModelSeries(NamedTuple):
    """The tracked series of one model, bound to its label."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter


class ServerMetrics:
    """The server's Prometheus metrics over ``pool``, in a registry of their own."""

    def __init__(self, pool: EnginePool) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(pool))
        label = ["model_name"]

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"aioengine:{name}", documentation, label, registry=self.registry, buckets=buckets)

        def counter(name: str, documentation: str, labels: list[str]) -> Counter:
            return Counter(f"aioengine:{name}", documentation, labels, registry=self.registry)

        self._ttft = histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.", E2E_BUCKETS)
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.", label)
        self._generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.", label)
        self._success = counter("request_success", "Finished requests.", [*label, "finished_reason"])
        self._series: dict[str, _ModelSeries] = {}
        for name in pool.tenants:  # every model's series exist from the first scrape, at 0
            self._model(name)
            for reason in FINISH_REASONS:
                self._success.labels(name, reason)

    def _model(self, model_name: str) -> _ModelSeries:
        series = self._series.get(model_name)
        if series is None:
            series = self._series[model_name] = _ModelSeries(
                ttft=self._ttft.labels(model_name),
                itl=self._itl.labels(model_name),
                e2e=self._e2e.labels(model_name),
                prompt_tokens=self._prompt_tokens.labels(model_name),
                generation_tokens=self._generation_tokens.labels(model_name),
            )
        return series

    def track(self, model_name: str) -> RequestTracker:
        """Starts timing a request the server accepted for ``model_name``."""
        return RequestTracker(self._model(model_name), self._success, model_name)

    def render(self) -> tuple[bytes, str]:
        """The body and content type of a ``GET /metrics`` answer (Prometheus text format)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """The timings of one request, from ``ServerMetrics.track`` to ``finish``; times are ``time.perf_counter``."""

    def __init__(self, series: _ModelSeries, success: Counter, model_name: str) -> None:
        self._series = series
        self._success = success
        self._model_name = model_name
        self._start = time.perf_counter()
        self._last: float | None = None
        """When the previous output with tokens arrived (None before the first)."""
        self._finished = False

    def tokens(self, n: int) -> None:
        """A streamed output brought ``n`` new tokens (summed over the request's choices).

        The first observes the time to first token (since ``track``). Each later one shares the time since
        the previous one among its ``n`` tokens: that time / ``n`` is observed ``n`` times, so the histogram
        counts every token after the first output, a burst weighing as many tokens as it holds. Calls with
        ``n < 1`` or after ``finish`` observe nothing.
        """
        if n < 1 or self._finished:
            return
        now = time.perf_counter()
        if self._last is None:
            self._series.ttft.observe(now - self._start)
        else:
            per_token = (now - self._last) / n
            for _ in range(n):
                self._series.itl.observe(per_token)
        self._last = now

    def finish(self, prompt_tokens: int, generation_tokens: int, finish_reason: str) -> None:
        """Observes the end-to-end latency, adds the request's tokens and counts it under ``finish_reason``
        ("stop" | "length" | "abort"). Only the first call counts: a server may call it from both the
        normal end and its cleanup."""
        if self._finished:
            return
        self._finished = True
        self._series.e2e.observe(time.perf_counter() - self._start)
        self._series.prompt_tokens.inc(prompt_tokens)
        self._series.generation_tokens.inc(generation_tokens)
        self._success.labels(self._model_name, finish_reason).inc()
