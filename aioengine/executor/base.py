"""Executor: the only bridge between the event loop and the workers.

Everything above runs on the asyncio loop; everything below on worker threads or processes.
Calls return awaitables, and the data that crosses is plain and picklable (aioengine.messages).
How the workers are reached (threads, processes, Ray actors), and what that costs the loop, is
the executor's business alone: EngineCore only submits steps and awaits their outputs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from aioengine.messages import ModelRunnerOutput, SchedulerOutput
from aioengine.worker.step_window import run_window

if TYPE_CHECKING:
    from aioengine.worker.base import WorkerBase

T = TypeVar("T")


def execute_and_sample(worker: WorkerBase, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    """``execute_model`` then, when it leaves rows to sample, ``sample_tokens``; a decode window in one go where
    the worker can (``execute_window``), else each of its steps so (``run_window``). Module level: picklable."""

    def one_step(step: SchedulerOutput) -> ModelRunnerOutput:
        output = worker.execute_model(step)
        return output if output is not None else worker.sample_tokens()

    if scheduler_output.num_steps == 1:
        return one_step(scheduler_output)
    output = worker.execute_window(scheduler_output)
    return output if output is not None else run_window(scheduler_output, one_step)


def bridge(future: concurrent.futures.Future[T]) -> asyncio.Future[T]:
    """An awaitable of a worker call. Unlike ``asyncio.wrap_future``, cancelling it does not withdraw the
    call: what was handed to a worker runs, in order (a step queued behind it may depend on it)."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future[T] = loop.create_future()

    def settle(done: concurrent.futures.Future[T]) -> None:
        if result.cancelled():
            return
        if done.cancelled():
            result.cancel()
        elif (exc := done.exception()) is not None:
            result.set_exception(exc)
        else:
            result.set_result(done.result())

    def on_done(done: concurrent.futures.Future[T]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(settle, done)

    future.add_done_callback(on_done)
    return result


def retrieve(future: asyncio.Future[Any]) -> None:
    """Marks a worker call's error as seen, for a future nobody awaits (or whose error another one explains), so
    asyncio does not log it."""
    if not future.cancelled():
        future.exception()


class OverdueCalls:
    """Calls whose caller timed out while they still run on a worker (steps wait behind them), each kept with its
    name and since when until it returns: what ``Executor.overdue_calls`` reports."""

    def __init__(self) -> None:
        self._calls: dict[asyncio.Future[Any], tuple[str, float]] = {}

    def add(self, futures: set[asyncio.Future[Any]], name: str) -> None:
        since = time.monotonic()
        for future in futures:
            self._calls[future] = (name, since)
            future.add_done_callback(self._returned)

    def _returned(self, future: asyncio.Future[Any]) -> None:
        self._calls.pop(future, None)
        retrieve(future)  # nobody awaits it any more

    def describe(self) -> list[str]:
        now = time.monotonic()
        return [f"{name!r} (timed out, running {now - since:.1f}s)" for name, since in self._calls.values()]


def call_name(method: str | Callable[..., Any]) -> str:
    """How errors, timeouts and ``overdue_calls`` name a worker call: the method's name, or the callable's."""
    return method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))


async def gather_replies(
    futures: list[asyncio.Future[Any]],
    name: str,
    timeout: float | None,
    unique_reply_rank: int | None,
    overdue: OverdueCalls,
    runs_in: str,
) -> Any:
    """``collective_rpc``'s answer from its ranks' ``futures``: one result per rank, or ``unique_reply_rank``'s.
    The first rank's error is raised as soon as it comes. Past ``timeout`` the calls still running are recorded in
    ``overdue`` and ``TimeoutError`` says where they run (``runs_in``)."""
    # asyncio.wait, not wait_for: a timeout must not cancel the futures, which track the calls until they return
    # (cancelling them would end the overdue record at once while the calls still run).
    done, running = await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
    for future in futures:
        if future in done and (error := future.exception()) is not None:
            raise error
    if running:
        # A call keeps its worker until it returns (a thread cannot be interrupted), and the steps queued behind
        # it wait: say so until it is over.
        overdue.add(running, name)
        raise TimeoutError(
            f"collective_rpc {name!r} timed out after {timeout}s; it still runs {runs_in} and model steps wait "
            "behind it until it returns"
        )
    results = [future.result() for future in futures]
    return results[unique_reply_rank] if unique_reply_rank is not None else results


class Executor(ABC):
    """Runs methods on every worker and gathers their results."""

    world_size: int = 1

    @abstractmethod
    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Calls ``method`` (a worker method name, or a callable taking the worker first) on every rank.

        Returns a list with one result per rank, or only ``unique_reply_rank``'s result.
        Raises ``TimeoutError`` naming the method when ``timeout`` seconds pass.
        """

    @abstractmethod
    def submit_step(self, scheduler_output: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        """Hands one step (forward, then sampling) to every worker NOW, behind the calls already queued,
        and returns the future of rank 0's output. Steps and RPCs run in the order they were submitted.

        Submitting does not wait: the caller may queue the next step before this one finishes
        (async scheduling) and publish the last one's outputs meanwhile.
        """

    def withdraw_step(self, step: asyncio.Future[ModelRunnerOutput]) -> bool:
        """Withdraws a submitted step that no worker has started, so that it never runs; True if it was.

        Only where the steps wait in this process until a worker takes them (the thread executor);
        executors that send each step to their workers at once (processes, Ray) keep it and return False.
        """
        return False

    @abstractmethod
    async def run_aside(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Runs a worker method on every rank OFF the step thread (e.g. staging weights while serving).

        Only for methods that read the model and never write it; returns one result per rank.
        """

    def overdue_calls(self) -> list[str]:
        """Calls whose caller timed out while they still hold a worker (steps wait behind them)."""
        return []

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the workers; safe to call more than once."""
