"""``aioengine serve``: the pool of engines behind uvicorn (httptools, on the caller's uvloop loop).

The socket is bound before the engines start, so a port in use fails at once; connections that arrive
while models load wait in the backlog. One line on stderr names the URL and the models once the server
takes requests. SIGTERM or Ctrl-C stops accepting connections, then, per ``server.shutdown``, lets requests
in flight finish (aborting what is left after ``shutdown_timeout``) or aborts them at once; a second
signal aborts everything. The process then exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import socket
import sys
from collections.abc import Iterator, Mapping

import uvicorn

from aioengine.config import EngineConfig
from aioengine.engine.pool import EnginePool
from aioengine.engine.sync import new_event_loop
from aioengine.errors import AIOEngineError
from aioengine.server import config as serve_config
from aioengine.server.app import build_app
from aioengine.server.config import ServerConfig

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server without its own signal handling (it re-raises the signal after shutdown, which would
    end the process with the signal's status instead of 0); ``serve`` installs handlers on the loop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Server:
    """The pool of engines behind uvicorn: ``await start()`` binds the socket and starts the engines (returns
    the URL), ``await run()`` serves until ``stop()``; ``run`` shuts the engines down when it ends."""

    def __init__(self, config: ServerConfig, engines: Mapping[str, EngineConfig]) -> None:
        self.config = config
        self.pool = EnginePool(
            dict(engines),
            budget_bytes=config.budget_bytes,
            max_awake=config.max_awake,
            idle_timeout=config.idle_timeout,
            sleep_level=config.sleep_level,
            awake_at_start=[next(iter(engines))],
        )
        self.sock: socket.socket | None = None
        self.uvicorn: _Server | None = None

    async def start(self) -> str:
        self.sock = bind(self.config.host, self.config.port)
        try:
            await self.pool.start()
        except BaseException:
            self.sock.close()
            raise
        app = build_app(self.pool, self.config)
        self.uvicorn = _Server(
            uvicorn.Config(
                app,
                http="httptools",
                lifespan="off",
                log_level=self.config.log_level,
                timeout_graceful_shutdown=math.ceil(self.config.shutdown_timeout),
                access_log=self.config.log_level in ("info", "debug"),
            )
        )
        return url(self.sock)

    async def run(self) -> None:
        assert self.sock is not None and self.uvicorn is not None, "start() first"
        try:
            await self.uvicorn.serve(sockets=[self.sock])
        finally:
            self.sock.close()
            await self.pool.shutdown()

    def stop(self, abort: bool | None = None) -> None:
        """Stops accepting connections; requests in flight finish, or are aborted when ``abort`` (default: the
        config's ``shutdown`` mode). Called again, it aborts everything and stops at once."""
        assert self.uvicorn is not None
        again = self.uvicorn.should_exit
        self.uvicorn.should_exit = True
        self.uvicorn.force_exit = again
        if again or (self.config.shutdown == "abort" if abort is None else abort):
            for tenant in self.pool.tenants.values():
                with contextlib.suppress(Exception):  # an engine that died has nothing left to abort
                    tenant.engine.abort_all()


async def serve(config: ServerConfig, engines: Mapping[str, EngineConfig]) -> int:
    """Serves until SIGTERM / SIGINT; returns the exit status (0 after a clean shutdown)."""
    server = Server(config, engines)
    address = await server.start()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        print("aioengine: shutting down", file=sys.stderr, flush=True)
        server.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(sig, on_signal)
    admin = "on" if config.admin_key else "off (no admin key)"
    models = ", ".join(server.pool.tenants)
    print(f"aioengine: serving {models} at {address}/v1 (admin endpoints {admin})", file=sys.stderr, flush=True)
    await server.run()
    return 0


def configure(args: argparse.Namespace) -> tuple[ServerConfig, dict[str, EngineConfig]]:
    """``aioengine serve``'s flags over its ``--config`` file: the server's settings and each model's engine."""
    from aioengine.cli import choose_model

    flags = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "admin_key": args.admin_key,
        "shutdown": args.shutdown,
        "shutdown_timeout": args.shutdown_timeout,
        "log_level": "info" if args.verbose else None,
    }
    engine = {"device": {"device": args.device}} if args.device else {}
    server, tables, shared = serve_config.load(args.config, flags, engine)
    given = args.served_model or args.model
    if args.served_model and args.model:
        raise ValueError("give the model once: as MODEL or as --model")
    if tables:
        if given or args.served_model_name:
            raise ValueError("the config's [models] table names the models served; drop MODEL / --served-model-name")
    else:
        model = choose_model(given, shared.get("model", {}).get("path"))
        tables = {args.served_model_name or model.name: serve_config.merge(shared, {"model": {"path": model.path}})}
    return server, {name: serve_config.engine_config(name, table) for name, table in tables.items()}


def main(args: argparse.Namespace) -> int:
    from aioengine.models import ModelConversionError

    try:
        server, engines = configure(args)
    except (FileNotFoundError, ValueError, ModelConversionError) as exc:
        print(f"aioengine: error: {exc}", file=sys.stderr)
        return 2
    loop = new_event_loop()
    try:
        return loop.run_until_complete(serve(server, engines))
    except (AIOEngineError, OSError) as exc:
        print(f"aioengine: error: {exc}", file=sys.stderr)
        return 1
    finally:
        loop.close()
