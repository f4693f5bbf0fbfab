"""Work that must not slow the steps beside it: run on a thread of its own at the OS's idle priority.

On a host whose cores all run the step (a CPU worker: two OpenMP threads on 2 cores), a third busy thread is not
a third of the machine taken: each time the OS lends that thread a core it stops one of the step's threads, and
the other waits at the next barrier. Staging 538 MiB of weights beside four greedy streams took the streams'
decode steps from 13 ms to 80-130 ms while it ran (a longer stream gap than the swap's own pause). Under Linux's
``SCHED_IDLE`` the thread runs only on a core nothing else wants: the steps keep their pace, and the work takes as
long as the idle time it finds (1-2 s there instead of 0.2 s; as fast as ever on an idle or a larger host).
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
    leave it without privileges, so it is only ever set on a thread made for the purpose."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as exc:  # no SCHED_IDLE here (macOS, Windows), or the OS refused
        logger.debug("SCHED_IDLE unavailable (%s): the work runs at normal priority", exc)


def run_at_priority(priority: CpuPriority, work: Callable[[], T], name: str) -> T:
    """``work()``'s result (or its exception), run at ``priority``: "normal" on the calling thread, "idle" on a new
    thread called ``name`` that the calling one waits for."""
    if priority == "normal":
        return work()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_lower_to_idle) as pool:
        return pool.submit(work).result()
