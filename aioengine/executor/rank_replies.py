"""How the replies of a call sent to every rank become the caller's one answer (``RemoteExecutor``): the error
that explains a failed step."""

from __future__ import annotations

import asyncio
from typing import Any

from aioengine.errors import EngineDeadError


def once_every_rank_answered(futures: list[asyncio.Future[Any]]) -> asyncio.Future[Any]:
    """Rank 0's output once every rank answered. A failed step fails with the error that explains it: a dead
    or hung rank's ``EngineDeadError`` (at once) before its peers' broken collectives, else the first error."""
    step: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    errors: list[BaseException] = []

    def settle(done: asyncio.Future[Any]) -> None:
        if not done.cancelled() and (error := done.exception()) is not None:
            errors.append(error)
        if step.done():
            return
        if dead := [e for e in errors if isinstance(e, EngineDeadError)]:
            step.set_exception(dead[0])
        elif all(f.done() for f in futures):
            if errors:
                step.set_exception(errors[0])
            else:
                step.set_result(futures[0].result())

    for future in futures:
        future.add_done_callback(settle)
    return step
