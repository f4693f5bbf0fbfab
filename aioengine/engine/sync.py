"""A blocking facade for scripts: ``Engine(config).generate(prompts, params) -> list[RequestOutput]``.

The AsyncEngine runs on its own event loop in a background thread; calls from the script's
thread are handed over with ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar, cast

from aioengine.config import EngineConfig
from aioengine.engine.async_engine import AsyncEngine, EngineStats, Prompt
from aioengine.engine.outputs import RequestOutput
from aioengine.errors import EngineDeadError
from aioengine.sampling.params import SamplingParams

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (faster), else the default loop."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class Engine:
    """Synchronous engine: start on construction, ``close()`` (or ``with``) to stop."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="aioengine-loop", daemon=True)
        self._thread.start()
        self.engine = AsyncEngine(config, **overrides)
        try:
            self._run(self.engine.start())
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()  # never started: close it so it is not reported as never awaited
            raise EngineDeadError("the engine was closed; create a new one")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt concurrently; returns the final outputs in prompt order.

        ``prompts`` is one prompt (a string or a list of token ids) or a list of them; ``params``
        one SamplingParams for all or one per prompt. Each request runs with ``output_kind="final_only"``
        (as vLLM's ``LLM.generate``): its stream is never read before its end, so none is built.
        """
        one_prompt = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch: list[Prompt] = [cast(Prompt, prompts)] if one_prompt else list(cast(Sequence[Prompt], prompts))
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"got {len(params)} SamplingParams for {len(batch)} prompts")
        return self._run(self._generate_all(batch, list(params), use_tqdm))

    async def _generate_all(
        self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm)

        async def one(prompt: Prompt, p: SamplingParams) -> RequestOutput:
            final_only = p.model_copy(update={"output_kind": "final_only"})  # only the last output is returned
            last = None
            async for out in self.engine.generate(prompt, final_only):
                last = out
            bar.update(1)
            assert last is not None
            return last

        # A TaskGroup: when one prompt is refused (or fails), the others are cancelled, which aborts their
        # requests, instead of running on with nobody to collect them.
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(pr, pa)) for pr, pa in zip(prompts, params, strict=True)]
        except BaseExceptionGroup as group_error:
            raise group_error.exceptions[0] from None
        finally:
            bar.close()
        return [task.result() for task in tasks]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        """Shuts the engine down and stops its loop thread; safe to call more than once."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            self._run(self.engine.shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
