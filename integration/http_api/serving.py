"""Running the HTTP API: uvicorn in an asyncio loop, optionally on a background thread.

* :class:`UvicornServer` — ``await start()`` binds (port 0 = a free port) and serves in the current
  loop; ``await stop()`` shuts down (open streams get ``grace_s`` seconds).
* :class:`BackgroundLoop` — an event loop on a daemon thread; ``run(coro)`` from any other thread.
  Synchronous clients (``text_generation.Client``, ``huggingface_hub.InferenceClient``) then call the
  server from the main thread while router, shards and server share the background loop.
* :class:`HttpStack` — router replay + app + server on a :class:`BackgroundLoop`, as a context
  manager: ``with HttpStack(uds_base_path, tokenizer) as stack: stack.base_url``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvicorn

from .app import create_app
from .generation import ApiConfig

T = TypeVar("T")


class UvicornServer:
    def __init__(
        self, app: Any, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", grace_s: float = 2.0
    ) -> None:
        self.config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="off",
            timeout_graceful_shutdown=grace_s,
            access_log=False,
        )
        self.server = uvicorn.Server(self.config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises the bind error
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.01)

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self.config.timeout_graceful_shutdown + 5)
        except asyncio.TimeoutError:
            self.server.force_exit = True
            await self._task
        self._task = None


class BackgroundLoop:
    """An asyncio loop on a daemon thread (a context manager that stops it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="http-api-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.run(cancel_rest(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()

    def __enter__(self) -> BackgroundLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HttpStack:
    """Router replay connected to ``{uds_base_path}-0``, the HTTP API and uvicorn, on a background loop.

    ``router_kwargs`` go to ``Router.connect`` (``max_batch_prefill_tokens``, ...); ``config`` defaults
    to ``ApiConfig(model_id=<tokenizer path or "tgi">)``; ``app_kwargs`` go to :func:`create_app`.
    ``loop``: share an existing :class:`BackgroundLoop` (e.g. one that also runs fake shards).
    """

    def __init__(
        self,
        uds_base_path: str,
        tokenizer: Any,
        *,
        config: ApiConfig | None = None,
        loop: BackgroundLoop | None = None,
        router_kwargs: dict[str, Any] | None = None,
        app_kwargs: dict[str, Any] | None = None,
        port: int = 0,
    ) -> None:
        self.uds_base_path = uds_base_path
        self.tokenizer = tokenizer
        self.config = config or ApiConfig(model_id=tokenizer if isinstance(tokenizer, str) else "tgi")
        self._own_loop = loop is None
        self.loop = loop or BackgroundLoop()
        self.router_kwargs = router_kwargs or {}
        self.app_kwargs = app_kwargs or {}
        self.port = port
        self.router: Any = None
        self.app: Any = None
        self.server: UvicornServer | None = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.loop.run(coro, timeout)

    @property
    def base_url(self) -> str:
        assert self.server is not None, "HttpStack is not started"
        return self.server.base_url

    def start(self) -> HttpStack:
        from integration.router_replay import Router

        async def up() -> None:
            self.router = await Router.connect(self.uds_base_path, self.tokenizer, **self.router_kwargs)
            self.app = create_app(self.router, self.config, **self.app_kwargs)
            self.server = UvicornServer(self.app, port=self.port)
            await self.server.start()

        try:
            self.run(up())
        except BaseException:
            self.stop(raise_fatal=False)
            raise
        return self

    def stop(self, *, raise_fatal: bool = True) -> None:
        """Stop the server and the router; re-raises a router fatal error unless ``raise_fatal=False``."""

        async def down() -> None:
            if self.server is not None:
                await self.server.stop()
            if self.router is not None:
                await self.router.close(raise_fatal=raise_fatal)

        try:
            if not self.loop.loop.is_closed():
                self.run(down())
        finally:
            if self._own_loop:
                self.loop.close()

    def __enter__(self) -> HttpStack:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop(raise_fatal=exc_type is None)
