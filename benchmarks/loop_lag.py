"""Event-loop lag: how late a 5 ms ticker wakes while the engine serves.

An application that embeds the engine runs its own coroutines on the same loop; every millisecond the
loop spends in engine code (scheduling, detokenizing, publishing) delays them. The ticker's oversleep
is that delay as the application sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), or None for no samples."""
    return float(np.percentile(values, q)) if values else None


class LoopLag:
    """``async with LoopLag() as lag:`` samples the oversleep of a ``interval``-second ticker inside the block."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._tick(), name="bench-loop-lag")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _tick(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.samples.append(max(0.0, time.perf_counter() - start - self.interval))

    def p99(self) -> float | None:
        return percentile(self.samples, 99)
