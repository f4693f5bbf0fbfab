"""Hot weight swap seconds, and the pause streams saw, beside reading the same bytes from disk.

    python -m benchmarks weight_swap [--device cpu] [--streams 4] [--repeats 1] [--keep DIR]

Two random-init Llama checkpoints of the same shape (A and B, ~560 MB of float32 each). An engine
with the weight-sync extension (plugins/weight_sync.py) serves A while a few greedy streams run; each
swap then writes the checkpoint it does not serve (A and B in turn), five ways, one row each:

1. ``update_weights(directory, mode="pause")``: read from the safetensors files in the pause.
2. the same with ``stage=True``: read and checked while serving, so the pause covers only the copy.
3. ``update_weights`` of a ``{name: tensor}`` dict in memory (what a trainer in the same process hands over).
4. ``collective_rpc("load_weights_from_tensors", dict, partial=False)``: the same dict through the
   extension, ordered with the steps like any RPC (no pause of its own).
5. the group push: a trainer process (benchmarks/weight_push.py) broadcasts the checkpoint's tensors
   over a gloo group on 127.0.0.1 while the engine's ``receive_weights(metadata, partial=False)``
   writes them as they arrive. The group opens (``init_weight_update_group``) before the first push
   and closes after the last: its setup is not timed.

With ``--repeats N`` each row is N swaps (A and B alternating) and shows the one of median seconds
(the slower of the middle two for an even N), with the range of the N beside it.

Beside them, in the same run (each measured before and after the engine's rows, the faster counting)
and with the page cache warmed by a first read, the floors: reading the
same files' bytes, and ``safetensors.torch.load_file`` + ``copy_`` into preallocated tensors (a swap's
work without the engine), which rows 1-4 cannot beat; and the transport floor of row 5: the same
trainer process broadcasting the same tensors (one broadcast per tensor, as ``receive_weights`` takes
them) into preallocated tensors of the benchmark process, no engine.

"Seconds" is the call's wall time as the benchmark sees it; GB/s is the bytes written over it; "x its
floor" is seconds over the floor the row is held to (``load_file`` + ``copy_`` for rows 1, 3 and 4, the
gloo broadcast for row 5; row 2 is held to its own pause: compare its stream gap with it). "Worker
write" (RPCs only) is ``WorkerWeightsReport.seconds``, the worker's timing of its one weight write
(``Worker.write_weights``): the names check, the copy and the repacking of weights, and for row 5 the
receive and each tensor's finite check as it arrives. Row 4's tensors are checked (finite) before that
write starts, so its "seconds" also hold that check; both also hold the wait for the step in flight.
"Pause in report" (``update_weights`` only; an RPC reports none) runs from the swap's request to
pause (it waits for the step in flight) to the resume. "Longest stream gap" is the longest wait
between two outputs of one stream that overlaps the whole update (staging included); an RPC holds
the worker's thread, so the streams wait for all of it. The steady gap (one decode step) is printed
for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from aioengine import AsyncEngine, EngineConfig, SamplingParams
from aioengine.engine.control import WeightUpdateReport
from aioengine.loopback import LOOPBACK
from aioengine.messages import WorkerWeightsReport
from aioengine.model.loader import checkpoint_files
from aioengine.testing import build_checkpoint
from benchmarks.results import median
from benchmarks.weight_push import TIMEOUT, Trainer, hf_tensors, join_group
from plugins.weight_sync import WeightSyncExtension, leave_group, weight_metadata

SPEC = dict(hidden_size=1024, intermediate_size=2048, num_layers=8, num_heads=16, num_kv_heads=8, vocab_size=32000)
PROMPT = list(range(10, 42))
TIMEOUT_S = TIMEOUT.total_seconds()
"""Seconds an RPC (joining the group included) may take before the benchmark gives up."""

READ_FLOOR = "read the same files' bytes (page cache warm)"
LOAD_FLOOR = "load_file + copy_ into tensors, no engine (page cache warm)"
"""The floor rows 1-4 are held to ("x its floor")."""
GLOO_FLOOR = "gloo broadcast from a trainer process into tensors, no engine"
"""The group push's floor: its transport alone."""

Report = WeightUpdateReport | WorkerWeightsReport
Change = Callable[[Path], Awaitable[Report]]
"""Writes the given checkpoint into the engine, one way; returns what that way reports."""


@dataclass
class Streams:
    """A few greedy streams, each restarted when it ends; every output's arrival time is kept."""

    stamps: list[tuple[float, float]] = field(default_factory=list)
    latest: list[float] = field(default_factory=list)
    """Each stream's latest output time."""
    stop: bool = False

    async def run(self, engine: AsyncEngine, num: int, max_tokens: int) -> None:
        """Runs ``num`` streams until ``stop``, each output's length drawn anew from U[max_tokens / 2,
        3 max_tokens / 2] (seeded per stream), so the streams restart at different steps. Streams of one
        length restart together: every prompt in one step, several decode steps long, at a fixed beat that
        a swap landing on it waits for and that no server's traffic has."""
        self.latest = [0.0] * num

        async def one(i: int) -> None:
            lengths = random.Random(i)
            while not self.stop:
                last = time.perf_counter()
                length = lengths.randint(max_tokens // 2, max_tokens * 3 // 2)
                params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
                async for _ in engine.generate([i + 3, *PROMPT], params):
                    now = self.latest[i] = time.perf_counter()
                    self.stamps.append((last, now))
                    last = now

        await asyncio.gather(*(one(i) for i in range(num)))

    async def caught_up(self, after: float, timeout: float = 30.0) -> None:
        """Returns once every stream had an output after ``after`` (so its gap across it is recorded)."""
        deadline = time.perf_counter() + timeout
        while min(self.latest, default=after) <= after and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)

    def gaps_within(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive outputs of one stream that overlap [start, end]."""
        return [b - a for a, b in self.stamps if b >= start and a <= end]


def best_of(fn: Any, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def disk_floors(path: Path) -> tuple[float, float, int]:
    """Seconds to read the checkpoint's files, and to load them into tensors, with the page cache warm.

    ``load_file`` maps the file lazily, so its tensors are copied into preallocated ones (as a swap
    copies into the parameters) to make it read every byte.
    """
    files = checkpoint_files(path)
    buffers = [bytearray(f.stat().st_size) for f in files]
    targets = [{n: t.clone() for n, t in load_file(str(f)).items()} for f in files]  # also warms the page cache

    def read_bytes() -> None:
        for f, buf in zip(files, buffers, strict=True):
            with open(f, "rb", buffering=0) as handle:
                handle.readinto(buf)

    def load_and_copy() -> None:
        for f, dst in zip(files, targets, strict=True):
            for name, tensor in load_file(str(f)).items():
                dst[name].copy_(tensor)

    nbytes = sum(t.numel() * t.element_size() for dst in targets for t in dst.values())
    return best_of(read_bytes), best_of(load_and_copy), nbytes


def transport_floor(checkpoint: Path) -> float:
    """Seconds for a trainer process to broadcast the checkpoint's tensors into preallocated tensors
    here, one broadcast per tensor as ``receive_weights`` takes them (the group-push row's floor)."""
    buffers = [torch.empty_like(t) for t in hf_tensors(checkpoint).values()]
    with Trainer([checkpoint]) as trainer:
        store, group = join_group(trainer.port)

        def receive() -> None:
            trainer.push(checkpoint)
            for buf in buffers:
                group.broadcast(buf, 0).wait()

        seconds = best_of(receive)
        trainer.end()
        leave_group(group)
        trainer.join()
        del store
    return seconds


@dataclass(frozen=True, slots=True)
class Swap:
    """One timed weight change: what it wrote, and how long it and the streams' longest wait took."""

    tensors: int
    bytes: int
    seconds: float
    """Wall time of the call, as the benchmark sees it."""
    worker_seconds: float | None
    """The worker's timing of the write (an RPC's ``WorkerWeightsReport``); None for update_weights."""
    pause_seconds: float | None
    """The engine's pause (``WeightUpdateReport``); None for an RPC, which reports none."""
    gap: float

    @staticmethod
    def of(report: Report, seconds: float, gap: float) -> Swap:
        if isinstance(report, WeightUpdateReport):
            return Swap(report.tensors, report.bytes, seconds, None, report.pause_seconds, gap)
        return Swap(report.tensors, report.bytes, seconds, report.seconds, None, gap)


@dataclass
class Serving:
    """Which of the two checkpoints the engine serves; each swap writes the other."""

    a: Path
    b: Path
    now: Path

    def other(self) -> Path:
        self.now = self.b if self.now == self.a else self.a
        return self.now


async def swap(streams: Streams, change: Awaitable[Report]) -> Swap:
    """Awaits the change; its report, wall time and the longest gap between two outputs of any stream meanwhile."""
    start = time.perf_counter()
    report = await change
    end = time.perf_counter()
    await streams.caught_up(end)  # the first step after a change can be slow: wait for it, not a fixed time
    gap = max(streams.gaps_within(start, end), default=float("nan"))
    await asyncio.sleep(0.5)  # let the streams settle before the next measurement
    return Swap.of(report, end - start, gap)


async def repeated(streams: Streams, serving: Serving, change: Change, repeats: int) -> list[Swap]:
    return [await swap(streams, change(serving.other())) for _ in range(repeats)]


async def rpc(engine: AsyncEngine, method: str, *args: Any, **kwargs: Any) -> Any:
    return await engine.collective_rpc(method, args=args, kwargs=kwargs, timeout=TIMEOUT_S, unique_reply_rank=0)


async def group_push(
    engine: AsyncEngine, streams: Streams, serving: Serving, tensors: dict[Path, dict[str, torch.Tensor]], repeats: int
) -> list[Swap]:
    """``repeats`` pushes from a trainer process, in one weight-update group opened before the first."""
    with Trainer([serving.a, serving.b]) as trainer:
        await rpc(engine, "init_weight_update_group", LOOPBACK, trainer.port, 1, 2, timeout_s=TIMEOUT_S)
        await asyncio.sleep(0.5)  # joining held the worker (and the streams) while the trainer read its tensors

        async def push(target: Path) -> Report:
            trainer.push(target)
            return await rpc(engine, "receive_weights", weight_metadata(tensors[target]), partial=False)

        pushes = await repeated(streams, serving, push, repeats)
        trainer.end()
        await rpc(engine, "close_weight_update_group")
        await asyncio.to_thread(trainer.join)
    return pushes


async def steady_gap(streams: Streams) -> float:
    """The median gap between outputs with nothing else going on: one decode step."""
    await asyncio.sleep(1.5)
    start = time.perf_counter()
    await asyncio.sleep(1.0)
    return statistics.median(streams.gaps_within(start, time.perf_counter()))


Row = tuple[str, list[Swap], str | None]
"""A row of the table: its name, its swaps, and the floor it is held to (None: none; a staged swap reads
while serving, so its pause and stream gap are what count, side by side in the row, not its whole call)."""


async def run(a: Path, b: Path, device: str, num_streams: int, repeats: int) -> tuple[float, list[Row]]:
    config = EngineConfig(
        model={"path": str(a)},
        device={"device": device},
        cache={"num_blocks": 256},
        parallel={"worker_extension_cls": WeightSyncExtension},
    )
    tensors = {a: hf_tensors(a), b: hf_tensors(b)}
    serving = Serving(a, b, now=a)
    async with AsyncEngine(config) as engine:
        changes: list[tuple[str, Change, str | None]] = [
            (
                'update_weights(directory, mode="pause")',
                lambda p: engine.update_weights(p, mode="pause"),
                LOAD_FLOOR,
            ),
            (
                'update_weights(directory, mode="pause", stage=True)',
                lambda p: engine.update_weights(p, mode="pause", stage=True),
                None,
            ),
            (
                'update_weights({tensors in memory}, mode="pause")',
                lambda p: engine.update_weights(tensors[p], mode="pause"),
                LOAD_FLOOR,
            ),
            (
                'collective_rpc("load_weights_from_tensors", {tensors in memory}, partial=False)',
                lambda p: rpc(engine, "load_weights_from_tensors", tensors[p], partial=False),
                LOAD_FLOOR,
            ),
        ]
        streams = Streams()
        load = asyncio.create_task(streams.run(engine, num_streams, max_tokens=32))
        steady = await steady_gap(streams)
        rows: list[Row] = [
            (name, await repeated(streams, serving, change, repeats), floor) for name, change, floor in changes
        ]
        push = await group_push(engine, streams, serving, tensors, repeats)
        rows.append(('group push: collective_rpc("receive_weights", metadata, partial=False)', push, GLOO_FLOOR))
        streams.stop = True
        await load
    return steady, rows


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(nbytes: int, floors: dict[str, float], rows: list[Row]) -> list[str]:
    """The markdown table: the floors, then each row's median swap (by seconds) and its seconds over the
    floor it is held to (the row's third item names it; None: none, "-")."""
    lines = [
        "| what | tensors | seconds | GB/s | x its floor | worker write s | pause in report s "
        "| longest stream gap during it s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, seconds in floors.items():
        lines.append(f"| {name} | - | {seconds:.3f} | {nbytes / seconds / 1e9:.2f} | - | - | - | - |")
    for name, swaps, floor in rows:
        m = median(swaps, lambda s: s.seconds)
        spread = f" ({min(s.seconds for s in swaps):.3f}-{max(s.seconds for s in swaps):.3f})" if len(swaps) > 1 else ""
        lines.append(
            f"| {name} | {m.tensors} | {m.seconds:.3f}{spread} | {m.bytes / m.seconds / 1e9:.2f} "
            f"| {'-' if floor is None else f'{m.seconds / floors[floor]:.2f}x'} | {_s(m.worker_seconds)} "
            f"| {_s(m.pause_seconds)} | {m.gap:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--streams", type=int, default=4, help="concurrent greedy streams during the swaps")
    parser.add_argument("--repeats", type=int, default=1, help="swaps per row (A and B alternating); the median shows")
    parser.add_argument("--keep", type=Path, default=None, help="build the checkpoints here and reuse them next run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        start = time.perf_counter()
        a = build_checkpoint(root / "swap-a", "llama", seed=0, **SPEC)  # type: ignore[arg-type]
        b = build_checkpoint(root / "swap-b", "llama", seed=1, **SPEC)  # type: ignore[arg-type]
        print(f"checkpoints ready in {time.perf_counter() - start:.1f}s")
        before = (*disk_floors(b)[:2], transport_floor(b))
        steady, rows = asyncio.run(run(a, b, args.device, args.streams, args.repeats))
        # Again after the engine, and the faster of the two counts: this host's memory bandwidth drifts
        # over a run, and a floor taken in a slow moment would flatter the rows.
        read_s, load_s, nbytes = disk_floors(b)
        floors = {
            READ_FLOOR: min(before[0], read_s),
            LOAD_FLOOR: min(before[1], load_s),
            GLOO_FLOOR: min(before[2], transport_floor(b)),
        }
    print(
        f"\ndevice {args.device}, {nbytes / 2**20:.0f} MiB of float32 weights, {args.streams} greedy streams "
        f"running (steady gap between outputs: {steady * 1e3:.0f} ms), {args.repeats} swap(s) per row\n"
    )
    print("\n".join(table(nbytes, floors, rows)))


if __name__ == "__main__":
    main()
