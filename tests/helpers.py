"""Small helpers shared by the engine tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from aioengine import AsyncEngine, EngineStats, RequestOutput
from aioengine.model.linear import Linear
from aioengine.model.packing import released_linears, set_weight_prepack

TIMEOUT = 60.0
"""Seconds any single await on the engine may take: a hung stream fails its test, not the run."""


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch on ``n`` threads inside the block, its count before restored after (oneDNN picks a weight copy's
    layout per thread count, so packing tests choose it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


async def last_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Consumes a generate() stream (engine or pool) and returns its final output."""
    out = None
    async with asyncio.timeout(TIMEOUT):
        async for item in stream:
            out = item
    assert out is not None, "the stream yielded nothing"
    return out


async def stream(engine: AsyncEngine, prompt: Any, params: Any, request_id: str | None = None) -> list[RequestOutput]:
    async with asyncio.timeout(TIMEOUT):
        return [out async for out in engine.generate(prompt, params, request_id=request_id)]


async def final(engine: AsyncEngine, prompt: Any, params: Any, request_id: str | None = None) -> RequestOutput:
    return await last_output(engine.generate(prompt, params, request_id=request_id))


async def wait_until(
    condition: Callable[[], bool], what: str, timeout: float = TIMEOUT, state: Callable[[], object] | None = None
) -> None:
    """Returns once ``condition()`` holds; fails naming ``what`` (and ``state()``) after ``timeout`` seconds.

    The way a test waits for the engine to reach a state (its stats, an output, a flag): it polls,
    yielding gently between tries (the worker thread needs the GIL), never trusting a fixed sleep.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"still not {what} after {timeout}s" + (f": {state()}" if state else ""))
        await asyncio.sleep(0.001)


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie (which whoever reaps it has not yet). A process that exits while
    its status is read leaves the file opened but unreadable (ProcessLookupError): gone as well."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "\nState:\tZ" in status


async def wait_until_idle(engine: AsyncEngine, timeout: float = 5.0) -> EngineStats:
    """Polls stats until no request holds a block or a queue slot; fails after ``timeout``."""

    def idle() -> bool:
        stats = engine.stats()
        return (
            stats.kv_blocks_free == stats.kv_blocks_total
            and stats.requests_running == stats.requests_waiting == stats.requests_held == 0
        )

    await wait_until(idle, "idle: a request still holds a block or a queue slot", timeout, engine.stats)
    return engine.stats()


def hf_generate(
    model: Any, prompts: list[list[int]], new_tokens: int | list[int], **generate_kwargs: Any
) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt (one at a time, no padding), EOS ignored;
    ``generate_kwargs`` go to ``model.generate`` (e.g. ``repetition_penalty``)."""
    import torch

    counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    outputs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, counts, strict=True):
            if n == 0:
                outputs.append([])
                continue
            ids = torch.tensor([prompt], device=model.device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                # ignore_eos keeps an argmax EOS and goes on; min_new_tokens alone would instead mask
                # EOS out of the logits and pick the runner-up. Without an EOS id HF does the former.
                eos_token_id=None,
                pad_token_id=model.config.pad_token_id,
                **generate_kwargs,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def packed_linear(kernels: ModuleType | None, out_features: int, in_features: int, hint: int = 64) -> Linear:
    """A served (no gradients) bias-free Linear on ``kernels`` (None: oneDNN only), packed for ``hint`` rows."""
    layer = Linear(in_features, out_features, bias=False).requires_grad_(False)
    layer.kernels = kernels
    set_weight_prepack(layer, hint)
    return layer


def weight_addresses(model: Any) -> dict[str, int]:
    """Where each parameter's values live: its data, or the packed copy's where that copy is the weight's one
    store (``Linear.plain_released``). A write in place keeps all of them."""
    released = released_linears(model)
    return {
        name: torch.ops.mkldnn.data_ptr(released[id(p)]._packed) if id(p) in released else p.data_ptr()
        for name, p in model.named_parameters()
    }
