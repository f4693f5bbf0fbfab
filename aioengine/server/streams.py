"""An HTTP request's engine requests (jobs) and how their outputs reach the client: merged as they come,
then as server-sent events. Closing a stream (the client went away) aborts every engine request of it at
once and lets the pool put its engine to sleep again."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aioengine.engine.async_engine import AsyncEngine
from aioengine.engine.outputs import RequestOutput, RequestStream
from aioengine.server.errors import engine_error
from aioengine.server.metrics import RequestTracker
from aioengine.server.protocol import Usage

SSEStream = AsyncIterator[str]


@dataclass(slots=True)
class Job:
    """One engine request of an HTTP request."""

    stream: RequestStream
    prompt_ids: list[int]
    tracker: RequestTracker
    first_choice: int
    prompt_text: str = ""
    last: RequestOutput | None = None
    generated: int = 0

    def observe(self, out: RequestOutput) -> None:
        self.last = out
        new = sum(len(o.delta_token_ids) for o in out.outputs)
        if new:
            self.tracker.tokens(new)
        self.generated = sum(len(o.token_ids) for o in out.outputs)
        if out.finished:
            self.tracker.finish(len(self.prompt_ids), self.generated, out.outputs[0].finish_reason or "stop")

    def close(self) -> None:
        self.stream.close()
        self.tracker.finish(len(self.prompt_ids), self.generated, "abort")  # no-op once finished


@dataclass(slots=True)
class Call:
    """An HTTP request's hold on its engine (``EnginePool.use``) and its engine requests."""

    engine: AsyncEngine
    hold: contextlib.AsyncExitStack
    jobs: list[Job] = field(default_factory=list)

    async def close(self) -> None:
        for job in self.jobs:
            job.close()
        await self.hold.aclose()

    def usage(self) -> Usage:
        prompt = sum(len(job.prompt_ids) for job in self.jobs)
        completion = sum(job.generated for job in self.jobs)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def merged(jobs: Sequence[Job]) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Every job's outputs as they come (one job: in place; several: interleaved through a queue)."""
    if len(jobs) == 1:
        async for out in jobs[0].stream:
            jobs[0].observe(out)
            yield jobs[0], out
        return
    queue: asyncio.Queue[tuple[Job, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for out in job.stream:
                queue.put_nowait((job, out))
        except Exception as exc:
            queue.put_nowait((job, exc))
        finally:
            queue.put_nowait((job, None))

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            job, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                job.observe(item)
                yield job, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse(chunks: AsyncIterator[dict[str, Any]], call: Call) -> SSEStream:
    """Server-sent events as OpenAI sends them; the engine requests end when this does (or is closed)."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"
    except Exception as exc:  # the answer has started: the error becomes the stream's last event
        yield f"data: {json.dumps(engine_error(exc).body())}\n\n"
    finally:
        await call.close()
    yield "data: [DONE]\n\n"
