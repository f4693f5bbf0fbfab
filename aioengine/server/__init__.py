"""The OpenAI-compatible HTTP server (``aioengine serve``): FastAPI + uvicorn in front of an ``EnginePool``."""
