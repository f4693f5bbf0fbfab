"""aioengine: an asyncio-native LLM inference engine to embed in your own process."""

from aioengine.config import EngineConfig
from aioengine.engine.async_engine import AsyncEngine
from aioengine.engine.outputs import RequestOutput
from aioengine.engine.pool import EnginePool
from aioengine.engine.sync import Engine
from aioengine.sampling.params import SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "EnginePool", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
