"""The trainer process of weight_swap's group-push row and of its transport floor.

    python -m benchmarks.weight_push PORT CHECKPOINT...     # run by Trainer, not by hand

The trainer process reads the checkpoints into memory, hosts a gloo weight-update group (rank 0 of
2, on 127.0.0.1:PORT; ``plugins.weight_sync.trainer_group``), then for each line of its stdin (one of
the checkpoints) broadcasts that checkpoint's tensors in ``weight_metadata`` order
(``broadcast_weights``). At the end of stdin it passes the barrier ``close_weight_update_group``
passes and leaves. The receiver is an engine (``receive_weights``) or, for the floor, the benchmark
process itself (:func:`join_group`) receiving into preallocated tensors.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from aioengine.model.loader import checkpoint_files, iter_safetensors
from aioengine.model.parallel import group_store, leave_group, make_group
from plugins.weight_sync import broadcast_weights, free_port, trainer_group

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = timedelta(seconds=120)
"""How long joining the group, or one broadcast, may wait for the other side."""


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in memory, HF names, in file order (the reader maps the files lazily, so cloned)."""
    return {name: t.clone() for name, t in iter_safetensors(checkpoint_files(path))}


class Trainer:
    """The trainer process: ``push(checkpoint)`` has it broadcast that checkpoint once.

    Its group exists once a receiver joined as rank 1 (``init_weight_update_group``, or
    :func:`join_group`). ``end()`` says no more pushes come; the receiver then closes its side of the
    group (both pass a barrier) and ``join()`` waits for the process.
    """

    def __init__(self, checkpoints: list[Path]) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "benchmarks.weight_push", str(self.port), *map(str, checkpoints)]
        self.process = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.PIPE, text=True)

    def push(self, checkpoint: Path) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{checkpoint}\n")
        self.process.stdin.flush()

    def end(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()

    def join(self) -> None:
        if (code := self.process.wait(TIMEOUT.total_seconds())) != 0:
            raise RuntimeError(f"the trainer process exited with {code} (its error is above)")

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def join_group(port: int) -> tuple[Any, Any]:
    """Rank 1 of the trainer's group, without an engine: (store, group); keep both while in use."""
    store = group_store(port, 1, 2, TIMEOUT)
    return store, make_group(store, 1, 2, "gloo", TIMEOUT)


def main() -> None:
    port, *paths = sys.argv[1:]
    torch.set_num_threads(1)
    tensors = {path: hf_tensors(Path(path)) for path in paths}  # read before the group opens: pushes time only the wire
    _store, group = trainer_group(int(port), world_size=2, timeout=TIMEOUT)
    for line in sys.stdin:
        broadcast_weights(group, tensors[line.strip()])
    leave_group(group)  # main's locals drop the group and store before the interpreter finalizes


if __name__ == "__main__":
    main()
