"""The shard process's gRPC server: build the engine, then listen on ``unix://{uds_path}-{rank}``.

The socket file appearing is the launcher's readiness signal, so the server binds only after the
engine is built. SIGTERM/SIGINT stop accepting calls, give in-flight calls ``GRACE_S`` seconds,
remove the socket file and return exit code 0.

All engine work (the build, every RPC, ``close``) runs on one dedicated thread, so thread-local
device state (current CUDA device, grad mode) set while building holds for every call.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from loguru import logger

from tgi_paged_backend.config import BackendConfig
from tgi_paged_backend.engine.interface import ShardEngine
from tgi_paged_backend.server.pb import generate_pb2_grpc as pb_grpc
from tgi_paged_backend.server.servicer import TextGenerationService, service_urls

EngineFactory = Callable[[BackendConfig], ShardEngine]
"""Builds the engine from the config (the CLI passes ``engine.build_engine``; tests a fake)."""

GRACE_S = 3.0
"""Seconds in-flight RPCs get after a termination signal."""

MAX_RECEIVE_MESSAGE_BYTES = 2**31 - 1
"""As stock: Warmup carries the dummy prompt twice and grows with ``max_batch_prefill_tokens``."""


def run(
    config: BackendConfig, engine_factory: EngineFactory, *, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code (0 after a signal, 1 on failure)."""
    try:
        return asyncio.run(serve(config, engine_factory, interceptors=interceptors))
    except Exception as err:  # noqa: BLE001 - reported on the launcher-visible log, not as a traceback on stderr
        logger.opt(exception=err).error(f"Shard failed: {err}")
        return 1


async def serve(
    config: BackendConfig,
    engine_factory: EngineFactory,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    stop: asyncio.Event | None = None,
    grace_s: float = GRACE_S,
) -> int:
    """Build the engine, bind the socket and serve until ``stop`` is set or a signal arrives.

    ``interceptors`` is the hook for server-side tracing. Signal handlers are installed only when
    running on the main thread (in-process tests run the server on another thread and use ``stop``).
    """
    loop = asyncio.get_running_loop()
    uds_path = os.path.abspath(config.server.uds_path)
    socket_path = f"{uds_path}-{config.server.rank}"
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tgi-engine")
    stop = stop if stop is not None else asyncio.Event()
    server: grpc.aio.Server | None = None
    engine: ShardEngine | None = None
    signals: list[signal.Signals] = []
    bound = False
    try:
        logger.info(f"Loading model {config.model.model_id} (rank {config.server.rank}/{config.server.world_size})")
        engine = await loop.run_in_executor(executor, engine_factory, config)

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, _on_signal, sig, stop)
                signals.append(sig)

        server = grpc.aio.server(
            interceptors=list(interceptors),
            options=[("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)],
        )
        servicer = TextGenerationService(engine, service_urls(uds_path, config.server.world_size), executor)
        pb_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
        _remove_stale_socket(socket_path)
        server.add_insecure_port(f"unix://{socket_path}")
        bound = True
        await server.start()
        logger.info(f"Server started at unix://{socket_path}")

        await stop.wait()
        begin_shutdown = getattr(engine, "begin_shutdown", None)
        if callable(begin_shutdown):  # tensor parallel: peers leaving from now on is expected
            begin_shutdown()
        return 0
    finally:
        if server is not None:
            await server.stop(grace_s)
        if bound:
            _remove_socket(socket_path)
        for sig in signals:
            loop.remove_signal_handler(sig)
        close = getattr(engine, "close", None)
        if callable(close):
            try:
                await loop.run_in_executor(executor, close)
            except Exception as err:  # noqa: BLE001 - shutting down anyway
                logger.opt(exception=err).warning(f"Engine close failed: {err}")
        executor.shutdown(wait=False, cancel_futures=True)
        if server is not None:
            logger.info("Server stopped")


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    logger.info(f"Received {sig.name}: shutting down")
    stop.set()


def _remove_stale_socket(path: str) -> None:
    """The launcher deletes stale sockets before spawning; do the same when started by hand."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
    logger.warning(f"Removing stale socket {path}")
    os.unlink(path)


def _remove_socket(path: str) -> None:
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
