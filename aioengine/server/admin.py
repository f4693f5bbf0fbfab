"""Admin endpoints (mounted only when an admin key is set, each behind it): sleep / wake, pause / resume,
weight updates from the server's disk, the prefix cache, and ``collective_rpc`` by method name.

Arguments come as a JSON object body or as query parameters (vLLM's ``/sleep?level=1``,
``/wake_up?tags=weights``); ``model`` picks the engine and may be left out when the server has one. A body
that is not JSON is refused with 415: nothing here ever unpickles, and ``collective_rpc`` takes a method
name and JSON arguments only (a callable cannot be sent over HTTP).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aioengine.engine.async_engine import AsyncEngine
from aioengine.engine.control import PauseMode, SleepMode, UpdateMode
from aioengine.engine.pool import EnginePool
from aioengine.messages import SleepLevel, WakeTag
from aioengine.server.errors import APIError, engine_error, validation_error

A = TypeVar("A", bound="_Args")
LIST_ARGS = frozenset({"tags", "args"})
"""Query parameters that are lists even when given once."""


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None


class SleepArgs(_Args):
    level: SleepLevel = 1
    mode: SleepMode = "wait"


class WakeArgs(_Args):
    tags: list[WakeTag] | None = None


class PauseArgs(_Args):
    mode: PauseMode = "abort"


class UpdateArgs(_Args):
    path: str = Field(description="A safetensors file or checkpoint directory on the server's disk.")
    mode: UpdateMode = "pause"
    partial: bool = False
    stage: bool = False


class ReloadArgs(_Args):
    mode: UpdateMode = "pause"


class ResetArgs(_Args):
    force: bool = False


class RpcArgs(_Args):
    method: str = Field(description="The name of a worker method (a worker extension's included).")
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = Field(None, gt=0)
    unique_reply_rank: int | None = None


async def arguments(request: Request, kind: type[A]) -> A:
    """Query parameters, then a JSON object body over them, checked as ``kind``."""
    data: dict[str, Any] = {}
    for key in request.query_params:
        values = [_query_value(v) for v in request.query_params.getlist(key)]
        data[key] = values if key in LIST_ARGS or len(values) > 1 else values[0]
    raw = await request.body()
    if raw:
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise APIError(415, f"admin endpoints take a JSON object body only, not {media or 'an untyped body'!r}")
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        data.update(body)
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _query_value(text: str) -> Any:
    """``level=1`` is the number 1 and ``force=true`` the boolean, as in a JSON body; anything else a string."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, int | float | bool) else text


def report(value: Any) -> Any:
    """A control call's report (a dataclass, maybe nested) as JSON."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: report(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [report(v) for v in value]
    if isinstance(value, dict):
        return {str(k): report(v) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def admin_router(pool: EnginePool, default_model: str) -> APIRouter:
    router = APIRouter()
    several = len(pool.tenants) > 1

    def name_of(args: _Args) -> str:
        if args.model is None and several:
            raise APIError(400, f"this server has several models ({', '.join(pool.tenants)}): name one", "model")
        return args.model or default_model

    def engine_of(args: _Args) -> AsyncEngine:
        try:
            return pool.engine(name_of(args))
        except Exception as exc:
            raise engine_error(exc) from exc

    async def run(call: Any) -> Any:
        try:
            return report(await call)
        except APIError:
            raise
        except Exception as exc:
            raise engine_error(exc) from exc

    @router.post("/sleep")
    async def sleep(request: Request) -> Any:
        args = await arguments(request, SleepArgs)
        return await run(pool.sleep(name_of(args), args.level, args.mode))

    @router.post("/wake_up")
    async def wake_up(request: Request) -> Any:
        args = await arguments(request, WakeArgs)
        return {"report": await run(pool.wake_up(name_of(args), args.tags))}

    @router.get("/is_sleeping")
    async def is_sleeping(request: Request) -> Any:
        args = await arguments(request, _Args)
        return {"is_sleeping": await run(engine_of(args).is_sleeping())}

    @router.post("/pause")
    async def pause(request: Request) -> Any:
        args = await arguments(request, PauseArgs)
        return await run(engine_of(args).pause_generation(args.mode))

    @router.post("/resume")
    async def resume(request: Request) -> Any:
        args = await arguments(request, _Args)
        await run(engine_of(args).resume_generation())
        return {"paused": False}

    @router.post("/update_weights")
    async def update_weights(request: Request) -> Any:
        args = await arguments(request, UpdateArgs)
        engine = engine_of(args)
        return await run(engine.update_weights(args.path, args.mode, partial=args.partial, stage=args.stage))

    @router.post("/reload_weights")
    async def reload_weights(request: Request) -> Any:
        args = await arguments(request, ReloadArgs)
        return await run(engine_of(args).reload_weights(args.mode))

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Any:
        args = await arguments(request, ResetArgs)
        return {"cached_blocks": await run(engine_of(args).reset_prefix_cache(args.force))}

    @router.post("/collective_rpc")
    async def collective_rpc(request: Request) -> Any:
        args = await arguments(request, RpcArgs)
        if args.method.startswith("__"):
            raise APIError(400, f"method {args.method!r}: dunder methods cannot be called", param="method")
        engine = engine_of(args)
        call = engine.collective_rpc(args.method, tuple(args.args), args.kwargs, args.timeout, args.unique_reply_rank)
        try:
            return {"results": report(await call)}
        except (AttributeError, TypeError) as exc:  # no such method, or arguments it does not take
            raise APIError(400, f"collective_rpc {args.method!r}: {exc}", param="method") from exc
        except Exception as exc:
            raise engine_error(exc) from exc

    return router
