"""A live HTTP server for tests: real sockets on 127.0.0.1 (a free port), in a thread with its own loop.

The server's engines belong to that loop; ``call`` runs a coroutine there (to read an engine's state or
drive it), so tests never touch an engine from the wrong loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from aioengine.config import EngineConfig
from aioengine.engine.pool import EnginePool
from aioengine.engine.sync import new_event_loop
from aioengine.server.config import ServerConfig
from aioengine.server.launch import Server
from tests.conftest import engine_config

T = TypeVar("T")
START_TIMEOUT = 120.0


class LiveServer:
    """``with LiveServer(engines, admin_key=...) as server:`` -> ``server.url``, ``server.base_url`` (…/v1)."""

    def __init__(self, engines: dict[str, EngineConfig], **server: Any) -> None:
        self.config = ServerConfig(**{"port": 0, **server})
        self.server = Server(self.config, engines)
        self.loop = new_event_loop()
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="aioengine-test-server", daemon=True)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def pool(self) -> EnginePool:
        return self.server.pool

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self.url = await self.server.start()
        self._ready.set()
        await self.server.run()

    def __enter__(self) -> LiveServer:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT):
            raise AssertionError(f"the server did not start within {START_TIMEOUT}s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(abort=True)
        self._thread.join(60)
        assert not self._thread.is_alive(), "the server thread did not stop"

    def stop(self, abort: bool | None = None) -> None:
        if self._thread.is_alive() and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.server.stop, abort)

    def call(self, make: Callable[[], Coroutine[Any, Any, T]], timeout: float = 60.0) -> T:
        """Runs ``make()`` on the server's loop and returns its result."""
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(make(), self.loop)
        return future.result(timeout)

    def stats(self, model: str | None = None) -> Any:
        """An engine's ``EngineStats``, read on the server's loop."""
        name = model or next(iter(self.pool.tenants))

        async def read() -> Any:
            return self.pool.engine(name).stats()

        return self.call(read)


def tiny_engines(path: Path, name: str = "tiny", **sections: Any) -> dict[str, EngineConfig]:
    """One model ``name`` on the random-init checkpoint at ``path`` (CPU, float32, a small cache)."""
    sections.setdefault("cache", {"num_blocks": 256})
    return {name: engine_config(path, **sections)}
