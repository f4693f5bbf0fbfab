"""The start-up heap frozen out of Python's garbage collector while engines serve (aioengine.gc_heap,
scheduler.freeze_gc): held by each engine that starts with it, undone by the last one to stop."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from aioengine import AsyncEngine, SamplingParams, gc_heap
from aioengine.errors import CheckpointError
from tests.conftest import engine_config
from tests.helpers import final


class _Node:
    """An object the collector tracks, for cycles and weak references."""

    def __init__(self) -> None:
        self.other: object = None


@pytest.fixture(autouse=True)
def unfrozen() -> None:
    """Every test starts with no holder, so the last release is the test's own."""
    assert gc_heap.holders() == 0, "an engine of an earlier test still holds the freeze"


def test_the_heap_stays_frozen_until_the_last_holder_releases_it() -> None:
    kept = _Node()
    gc_heap.hold()
    assert gc_heap.holders() == 1
    frozen = gc.get_freeze_count()
    assert frozen > 0
    gc_heap.hold()  # a second engine: its own objects are frozen too, the first hold's stay
    assert gc_heap.holders() == 2
    assert gc.get_freeze_count() >= frozen
    gc_heap.release()
    assert gc_heap.holders() == 1
    assert gc.get_freeze_count() > 0
    gc_heap.release()
    assert gc_heap.holders() == 0
    assert gc.get_freeze_count() == 0
    assert gc.is_tracked(kept)  # back with the collector


def test_a_hold_collects_garbage_first_so_none_is_frozen_for_good() -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    gc_heap.hold()
    try:
        assert dead() is None
    finally:
        gc_heap.release()


def test_objects_allocated_after_the_freeze_are_still_collected() -> None:
    gc_heap.hold()
    try:
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        dead = weakref.ref(a)
        del a, b
        gc.collect()
        assert dead() is None
    finally:
        gc_heap.release()


def test_a_release_without_a_hold_is_refused() -> None:
    with pytest.raises(RuntimeError, match="without a hold"):
        gc_heap.release()


async def test_an_engine_holds_the_freeze_while_it_runs(llama_ckpt: Path) -> None:
    async with AsyncEngine(engine_config(llama_ckpt)) as first:
        assert gc_heap.holders() == 1
        assert gc.get_freeze_count() > 0
        async with AsyncEngine(engine_config(llama_ckpt)) as second:
            assert gc_heap.holders() == 2
            assert (await final(second, [5, 9, 13], SamplingParams(max_tokens=2))).token_ids
        assert gc_heap.holders() == 1
        assert gc.get_freeze_count() > 0  # the first engine still serves
        assert (await final(first, [5, 9, 13], SamplingParams(max_tokens=2))).token_ids
    assert gc_heap.holders() == 0
    assert gc.get_freeze_count() == 0


async def test_freeze_gc_off_leaves_the_collector_alone(llama_ckpt: Path) -> None:
    async with AsyncEngine(engine_config(llama_ckpt, scheduler={"freeze_gc": False})):
        assert gc_heap.holders() == 0
        assert gc.get_freeze_count() == 0


async def test_an_engine_whose_start_fails_holds_nothing(tmp_path: Path) -> None:
    engine = AsyncEngine(engine_config(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        await engine.start()
    await engine.shutdown()
    assert gc_heap.holders() == 0
    assert gc.get_freeze_count() == 0
