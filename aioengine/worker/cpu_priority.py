"""Work that must not slow the steps beside it (weight staging): on a thread made for it, at the OS's idle priority.

Two things slowed a CPU worker's steps while, and after, such work ran on a lasting thread of its own:

- While: on a host whose cores all run the step (two OpenMP threads on 2 cores), a third busy thread is not a third
  of the machine taken: each time the OS lends it a core it stops one of the step's threads, and the other waits at
  the next barrier. Staging 538 MiB of weights beside four greedy streams took their decode steps from 13 ms to
  80-130 ms. Under Linux's ``SCHED_IDLE`` the thread runs only on a core nothing else wants: the steps keep their
  pace, and the work takes the idle time it finds (1-2 s there instead of 0.2 s; as fast as ever on an idle or a
  larger host).
- After: a thread that ran a parallel torch op keeps an OpenMP team for as long as it lives. Once a process holds
  more OpenMP threads than cores, libgomp cuts every team's spin-wait to ~100 iterations, so the step's threads
  sleep between parallel regions and each region waits for a futex wake: offline runs of the tiny model were
  10-18% slower for good after one staged swap. A thread that ends frees its team.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from aioengine.config_sections import CpuPriority

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _lower_to_idle() -> None:
    """Puts the calling thread (and the threads it starts, OpenMP's among them) in ``SCHED_IDLE``. A thread cannot
    leave it without privileges: it is only ever set on a thread made for the purpose."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # no SCHED_IDLE here (macOS, Windows), or the OS refused
        logger.debug("SCHED_IDLE unavailable (%s): the work runs at normal priority", exc)


def run_at_priority(priority: CpuPriority, work: Callable[[], T], name: str) -> T:
    """``work()``'s result (or its exception), run on a new thread called ``name`` that ends with it (the calling
    thread waits for it): at the OS's idle priority ("idle"), or as any thread of the process ("normal")."""
    lower = _lower_to_idle if priority == "idle" else None
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name, initializer=lower) as pool:
        return pool.submit(work).result()
