"""What the engine knows of its workers' memory: asleep or awake, and whether the weights can serve.

One immutable record, owned by EngineCore (``core.memory``) and replaced whole by the control
operations when a worker call succeeds; everyone else (AsyncEngine, EnginePool, stats) asks it.
The workers keep the device-side truth (their sleep backends) and report it back on every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from aioengine.messages import WAKE_TAGS, SleepLevel, WakeTag


@dataclass(frozen=True, slots=True)
class MemoryState:
    """The engine's view of its workers' memory."""

    asleep: frozenset[WakeTag] = field(default_factory=frozenset)
    """Tags a sleep freed and no wake has restored yet. A sleep marks every tag (on a CPU device level 1
    frees only the KV cache, but scheduling still waits for a full wake)."""
    level: SleepLevel | None = None
    """The level of the sleep in progress (None while awake)."""
    weights_valid: bool = True
    """False from a level-2 sleep until a full weight write (reload or update) fills the weights again."""

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    @property
    def can_serve(self) -> bool:
        """Steps may run: everything is awake and the weights are loaded."""
        return not self.asleep and self.weights_valid

    def fell_asleep(self, level: SleepLevel) -> MemoryState:
        return MemoryState(frozenset(WAKE_TAGS), level, self.weights_valid and level == 1)

    def woke(self, tags: tuple[WakeTag, ...]) -> MemoryState:
        asleep = self.asleep.difference(tags)
        return MemoryState(asleep, self.level if asleep else None, self.weights_valid)

    def with_weights(self, valid: bool) -> MemoryState:
        """The same state after a weight write that left the weights valid (or not)."""
        return replace(self, weights_valid=valid)

    def why_not_serving(self) -> str:
        """A sentence naming what keeps the engine from serving and the call that ends it."""
        if self.asleep:
            return f"the engine is asleep ({', '.join(sorted(self.asleep))}); call wake_up()"
        if not self.weights_valid:
            return "the weights were discarded by sleep(level=2); call reload_weights() or update_weights()"
        return "the engine is serving"
