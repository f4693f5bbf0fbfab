"""The process's startup heap, kept out of Python's full garbage collections while engines serve.

A full (generation 2) collection walks every object the collector tracks. After importing torch and
transformers that is some 330K objects: 150-200 ms on a 2-core host, with the GIL held, so the event
loop and the worker thread both stop for it. Serving allocates steadily (a step's inputs, outputs,
lists of token ids), so such a collection comes every few thousand steps and shows as one long stall in
the loop's lag and a slow step. Nearly all of those objects live as long as the process (modules,
functions, the model's modules and parameters, the tokenizer): ``gc.freeze()`` moves everything alive
into a permanent generation the collector skips, and later garbage is collected as before, by walking
only what was allocated since. vLLM's engine core does the same after its start-up.

The freeze is process state, and engines share a process (a pool, several engines in one
application), so this module owns it: each engine that starts with ``scheduler.freeze_gc`` holds it
(``hold``: one collection first, so no garbage is frozen, then the freeze, which also takes in what the
engine just built) and gives it back when it stops (``release``); the last one out unfreezes, and the
objects go back to the collector's oldest generation. A worker process serves one rank and nothing else,
so it freezes once after its warm-up (``freeze_for_good``) and never unfreezes.

Below the executor (worker processes use it): no asyncio here.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["freeze_for_good", "hold", "holders", "release"]

_lock = threading.Lock()
_holders = 0


def _collect_and_freeze() -> None:
    gc.collect()  # garbage frozen would never be freed: collect it first
    gc.freeze()


def hold() -> None:
    """Collects once and freezes every object alive; the heap stays frozen until the last ``release``."""
    global _holders
    with _lock:
        _collect_and_freeze()
        _holders += 1


def release() -> None:
    """Gives back one ``hold``; the last one unfreezes (everything goes back to the oldest generation)."""
    global _holders
    with _lock:
        if _holders == 0:
            raise RuntimeError("gc_heap.release() without a hold")
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()


def holders() -> int:
    """How many engines hold the freeze now."""
    return _holders


def freeze_for_good() -> None:
    """A worker process's freeze after its warm-up: the process ends with its rank, so it is never undone."""
    with _lock:
        _collect_and_freeze()
