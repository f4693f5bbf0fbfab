"""How busy the rest of the machine was during a measurement, so a noisy number can be told apart.

Systems run one after another; another process taking the cores during one of them skews its ratio
(on a shared 2-core machine, by up to 10x). ``others`` is the CPU the machine spent outside this
process, in cores, averaged over the block: /proc/stat busy time minus this process's CPU time.
"""

from __future__ import annotations

import os
import time


def _machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuLoad:
    """``with CpuLoad() as load:`` then ``load.others`` (cores busy elsewhere; None off Linux)."""

    def __init__(self) -> None:
        self.others: float | None = None

    def __enter__(self) -> CpuLoad:
        self._busy = _machine_busy_seconds()
        self._own = time.process_time()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy = _machine_busy_seconds()
        wall = time.perf_counter() - self._wall
        if busy is None or self._busy is None or wall <= 0:
            return
        own = time.process_time() - self._own
        self.others = max(0.0, (busy - self._busy - own) / wall)
