"""EngineStats: a snapshot of an engine's state, cheap enough to poll, read from the core that owns it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aioengine.engine.core import EngineCore


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's state, cheap enough to poll."""

    started: bool
    dead: bool = False
    kv_blocks_total: int = 0
    """Blocks requests can hold (the cache's blocks minus the null block)."""
    kv_blocks_free: int = 0
    block_size: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_generated_tokens: int = 0
    worker_seconds: float = 0.0
    weights_version: int = 0
    requests_held: int = 0
    """Requests that arrived during a drain and wait for it to end."""
    draining: bool = False
    """A control call (sleep "wait", update_weights "drain") is finishing the requests in flight."""
    paused: bool = False
    """Generation is paused (pause_generation) until resume_generation; requests sent meanwhile wait."""
    sleeping: tuple[str, ...] = ()
    weights_valid: bool = True
    max_model_len: int | None = None
    prefix_cache_queries: int = 0
    """Prompt tokens of admitted requests that looked up the prefix cache (a preempted one counts again)."""
    prefix_cache_hits: int = 0
    """Of those, the tokens whose KV was reused instead of computed."""
    prefix_cache_blocks: int = 0
    """Blocks holding a cached prefix now (held by requests or free, reused when needed)."""
    num_swapped_out: int = 0
    """Preemptions that moved the request's KV to the host pool (preemption_mode "swap"); the rest recomputed."""
    host_blocks_free: int = 0
    """Free blocks of the host pool swapped-out KV goes to (0 without swap)."""
    num_revoked_steps: int = 0
    """Steps queued behind the running one that a control call took back before they ran (they run after it)."""

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (for logs, metrics, HTTP)."""
        return {**asdict(self), "prefix_cache_hit_rate": self.prefix_cache_hit_rate}


def engine_stats(core: EngineCore | None, max_model_len: int | None) -> EngineStats:
    """The stats of the engine ``core`` drives (not started: None)."""
    if core is None:
        return EngineStats(started=False)
    scheduler = core.scheduler
    return EngineStats(
        started=True,
        dead=core.dead is not None,
        kv_blocks_total=scheduler.kv.num_usable_blocks,
        kv_blocks_free=scheduler.kv.num_free_blocks,
        block_size=scheduler.kv.block_size,
        requests_running=scheduler.num_running,
        requests_waiting=scheduler.num_waiting,
        num_preemptions=scheduler.num_preemptions,
        num_steps=core.num_steps,
        num_generated_tokens=core.num_generated_tokens,
        worker_seconds=core.worker_seconds,
        weights_version=core.weights_version,
        requests_held=len(core.held),
        draining=core.draining,
        paused=core.paused,
        sleeping=tuple(sorted(core.memory.asleep)),
        weights_valid=core.memory.weights_valid,
        max_model_len=max_model_len,
        prefix_cache_queries=scheduler.kv.num_query_tokens,
        prefix_cache_hits=scheduler.kv.num_hit_tokens,
        prefix_cache_blocks=scheduler.kv.num_cached_blocks,
        num_swapped_out=scheduler.num_swapped_out,
        host_blocks_free=scheduler.num_host_blocks_free,
        num_revoked_steps=scheduler.num_revoked,
    )
