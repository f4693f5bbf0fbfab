"""aioengine: an asyncio-native LLM inference engine to embed in your own process.

The public names load on first use, so that importing a lower layer (``aioengine.worker``, in a
worker process) does not load the asyncio side, and ``aioengine.scheduler`` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Re-exported for type checkers (the redundant aliases mark them so); loaded lazily by __getattr__.
    from aioengine.config import EngineConfig as EngineConfig
    from aioengine.engine.async_engine import AsyncEngine as AsyncEngine
    from aioengine.engine.outputs import CompletionOutput as CompletionOutput
    from aioengine.engine.outputs import Logprob as Logprob
    from aioengine.engine.outputs import RequestOutput as RequestOutput
    from aioengine.engine.outputs import ScoreOutput as ScoreOutput
    from aioengine.engine.pool import EnginePool as EnginePool
    from aioengine.engine.stats import EngineStats as EngineStats
    from aioengine.engine.sync import Engine as Engine
    from aioengine.sampling.params import SamplingParams as SamplingParams

_EXPORTS = {
    "AsyncEngine": "aioengine.engine.async_engine",
    "CompletionOutput": "aioengine.engine.outputs",
    "Logprob": "aioengine.engine.outputs",
    "ScoreOutput": "aioengine.engine.outputs",
    "Engine": "aioengine.engine.sync",
    "EngineConfig": "aioengine.config",
    "EnginePool": "aioengine.engine.pool",
    "EngineStats": "aioengine.engine.stats",
    "RequestOutput": "aioengine.engine.outputs",
    "SamplingParams": "aioengine.sampling.params",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aioengine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
