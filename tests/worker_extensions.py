"""Worker extensions and worker classes used by the tests (importable by qualname)."""

from __future__ import annotations

from typing import Any

import torch

from aioengine.worker.cpu_worker import CPUWorker


class EchoExtension:
    """Answers with data from the worker it is mixed into."""

    def echo_rank(self, suffix: str = "") -> str:
        return f"rank{self.rank}{suffix}"  # type: ignore[attr-defined]

    def raise_value_error(self, message: str) -> None:
        raise ValueError(message)

    def sleep_for(self, seconds: float) -> float:
        import time

        time.sleep(seconds)
        return seconds


class OtherExtension:
    def other_method(self) -> str:
        return "other"


class ClashingExtension:
    def load_model(self) -> None:  # clashes with the worker's own method
        pass


class ForcedTokenWorker(CPUWorker):
    """Acts between the forward and sampling: every sampled token becomes ``FORCED``."""

    FORCED = 7

    def sample_tokens(self) -> Any:
        runner = self.model_runner
        assert runner is not None
        logits = runner.pending_logits
        assert logits is not None
        with torch.inference_mode():  # the logits are inference tensors
            logits.fill_(0.0)
            logits[:, self.FORCED] = 1.0
        return super().sample_tokens()


class ComposedClashingExtension(EchoExtension, ClashingExtension):
    """Defines nothing itself: the clash comes from a base mixin."""


class HalfMemoryOnRank1Worker(CPUWorker):
    """A CPU worker whose rank 1 offers half the KV memory rank 0 does (the engine must take the minimum)."""

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        return available // 2 if self.rank == 1 else available
