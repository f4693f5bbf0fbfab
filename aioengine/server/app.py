"""The FastAPI app: OpenAI endpoints, serving habits (health, version, tokenize, metrics) and, with an admin
key, the admin endpoints. Every error answers in OpenAI's shape; the server keeps serving after any of them.

Keys are compared in constant time (``hmac.compare_digest``): no header is a 401, a wrong key a 403.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from aioengine import __version__
from aioengine.engine.pool import EnginePool
from aioengine.server.config import ServerConfig
from aioengine.server.errors import APIError, engine_error, field_errors
from aioengine.server.metrics import ServerMetrics
from aioengine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    chat_messages,
    error_body,
)
from aioengine.server.serving import OpenAIServing

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its (non-streamed) answer was ready."""


def bearer(key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A dependency that lets a request through only with ``Authorization: Bearer <key>`` (any, if None)."""

    async def check(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "missing key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(403, "the key given is not valid for this endpoint", code="invalid_api_key")

    return check


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs ``work`` unless the client goes away first; then cancels it (its engine requests are aborted and
    their blocks freed at once) and raises ``ClientDisconnected``."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


def build_app(pool: EnginePool, config: ServerConfig, metrics: ServerMetrics | None = None) -> FastAPI:
    """The app serving every model of ``pool``; the pool must be started (and shut down) by the caller."""
    app = FastAPI(title="aioengine", version=__version__, docs_url=None, redoc_url=None)
    metrics = metrics if metrics is not None else ServerMetrics(pool)
    serving = OpenAIServing(pool, metrics)
    created = int(time.time())
    user = [Depends(bearer(config.api_key))]
    default_model = next(iter(pool.tenants))
    app.state.pool, app.state.metrics, app.state.serving = pool, metrics, serving

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(field_errors(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind, code=exc.status_code), status_code=exc.status_code)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(engine_error(exc))

    async def answer(request: Request, work: Awaitable[Any]) -> Any:
        try:
            result = await until_disconnect(request, work)
        except (APIError, ClientDisconnected):
            raise
        except Exception as exc:
            raise engine_error(exc) from exc
        if isinstance(result, BaseModel):
            return JSONResponse(result.model_dump())
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions", dependencies=user)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await answer(request, serving.completions(body))

    @app.post("/v1/chat/completions", dependencies=user)
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await answer(request, serving.chat(body))

    @app.get("/v1/models", dependencies=user)
    async def models() -> ModelList:
        cards = []
        for name, tenant in pool.tenants.items():
            engine = tenant.engine
            cards.append(
                ModelCard(
                    id=name,
                    created=created,
                    root=engine.config.model.path,
                    max_model_len=engine.stats().max_model_len,
                    sleeping=not engine.is_awake,
                )
            )
        return ModelList(data=cards)

    @app.get("/health")
    async def health() -> Response:
        stats = {name: t.engine.stats() for name, t in pool.tenants.items()}
        dead = [name for name, s in stats.items() if s.dead or not s.started]
        if dead:
            return JSONResponse(error_body(f"engine not alive: {', '.join(dead)}", "server_error"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize", dependencies=user)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        engine = _engine(pool, body.model or default_model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        try:
            if body.messages is not None:
                messages = chat_messages(body.messages)
                ids = await engine.tokenize(messages=messages)
            elif body.add_special_tokens:
                ids = await engine.tokenize(body.prompt)
            else:
                ids = list(engine.tokenizer(body.prompt, add_special_tokens=False).input_ids)
        except Exception as exc:
            raise engine_error(exc) from exc
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.stats().max_model_len}

    @app.post("/detokenize", dependencies=user)
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        engine = _engine(pool, body.model or default_model)
        vocab = len(engine.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids outside the vocabulary (0..{vocab - 1}): {bad[:8]}", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    if config.admin_key is not None:
        from aioengine.server.admin import admin_router

        app.include_router(admin_router(pool, default_model), dependencies=[Depends(bearer(config.admin_key))])
    return app


def _engine(pool: EnginePool, name: str) -> Any:
    try:
        return pool.engine(name)
    except Exception as exc:
        raise engine_error(exc) from exc


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)
