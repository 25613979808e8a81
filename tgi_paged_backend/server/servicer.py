"""The ``generate.v3.TextGenerationService`` servicer: protobuf in, engine call, protobuf out.

Every RPC that touches the engine runs one at a time (the stock server is serialised too, and the
router's ``/health`` probe relies on it) in a worker thread, so the event loop stays free to
accept calls. Errors become gRPC statuses and the server keeps running:

- :class:`InvalidRequestError` -> ``INVALID_ARGUMENT``
- :class:`BatchNotFoundError`  -> ``NOT_FOUND``
- anything else                -> ``INTERNAL`` (traceback logged)
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import TypeVar

import grpc
from loguru import logger

from tgi_paged_backend.engine.interface import ShardEngine
from tgi_paged_backend.engine.types import BatchNotFoundError, InvalidRequestError
from tgi_paged_backend.server import convert
from tgi_paged_backend.server.pb import generate_pb2 as pb
from tgi_paged_backend.server.pb import generate_pb2_grpc as pb_grpc

T = TypeVar("T")


def service_urls(uds_path: str, world_size: int) -> list[str]:
    """``unix://{uds_path}-{rank}`` for every rank, in rank order (the router dials the path after ``unix://``)."""
    return [f"unix://{uds_path}-{rank}" for rank in range(world_size)]


class TextGenerationService(pb_grpc.TextGenerationServiceServicer):
    """Thin adapter from ``generate.v3`` to a :class:`ShardEngine`."""

    def __init__(self, engine: ShardEngine, server_urls: Sequence[str], executor: Executor | None = None) -> None:
        """``executor`` runs the engine calls (``None``: asyncio's default pool)."""
        self._engine = engine
        self._server_urls = list(server_urls)
        self._executor = executor
        self._rpc_lock = asyncio.Lock()
        # Held by the worker around each engine call: if an RPC is cancelled while its call is
        # still running, the next RPC must not enter the engine before that call returns.
        self._engine_lock = threading.Lock()

    # -- RPCs ---------------------------------------------------------------------------------

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return await self._call(context, "Info", lambda: convert.info_to_pb(self._engine.info()))

    async def ServiceDiscovery(
        self, request: pb.ServiceDiscoveryRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServiceDiscoveryResponse:
        return pb.ServiceDiscoveryResponse(urls=self._server_urls)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        def work() -> pb.HealthResponse:
            self._engine.health()
            return pb.HealthResponse()

        return await self._call(context, "Health", work)

    async def ClearCache(
        self, request: pb.ClearCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClearCacheResponse:
        batch_id = request.id if request.HasField("id") else None

        def work() -> pb.ClearCacheResponse:
            self._engine.clear_cache(batch_id)
            return pb.ClearCacheResponse()

        return await self._call(context, "ClearCache", work)

    async def FilterBatch(
        self, request: pb.FilterBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.FilterBatchResponse:
        def work() -> pb.FilterBatchResponse:
            kept = self._engine.filter_batch(request.batch_id, list(request.request_ids))
            return pb.FilterBatchResponse(batch=convert.cached_batch_to_pb(kept))

        return await self._call(context, "FilterBatch", work)

    async def Warmup(self, request: pb.WarmupRequest, context: grpc.aio.ServicerContext) -> pb.WarmupResponse:
        def work() -> pb.WarmupResponse:
            result = self._engine.warmup(
                convert.batch_from_pb(request.batch),
                max_input_tokens=request.max_input_tokens if request.HasField("max_input_tokens") else None,
                max_prefill_tokens=request.max_prefill_tokens,
                max_total_tokens=request.max_total_tokens if request.HasField("max_total_tokens") else None,
            )
            return convert.warmup_to_pb(result)

        return await self._call(context, "Warmup", work)

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        def work() -> pb.PrefillResponse:
            start = time.perf_counter_ns()
            cached_batch_id = request.cached_batch.id if request.HasField("cached_batch") else None
            try:
                batch = convert.batch_from_pb(request.batch)
            except InvalidRequestError:
                # The router fails the cached batch's requests too: they must not stay here.
                if cached_batch_id is not None:
                    self._engine.release_batches([cached_batch_id])
                raise
            result = self._engine.prefill(batch, cached_batch_id)
            return convert.step_result_to_pb(result, pb.PrefillResponse, time.perf_counter_ns() - start)

        return await self._call(context, "Prefill", work)

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> pb.DecodeResponse:
        def work() -> pb.DecodeResponse:
            start = time.perf_counter_ns()
            if not request.batches:
                raise InvalidRequestError("Decode needs at least one batch")
            result = self._engine.decode([b.id for b in request.batches])
            return convert.step_result_to_pb(result, pb.DecodeResponse, time.perf_counter_ns() - start)

        return await self._call(context, "Decode", work)

    # -- plumbing -----------------------------------------------------------------------------

    async def _call(self, context: grpc.aio.ServicerContext, rpc: str, work: Callable[[], T]) -> T:
        """Run ``work`` (conversion + engine call) in the worker, one RPC at a time; map errors."""
        async with self._rpc_lock:
            try:
                return await self._in_worker(work)
            except InvalidRequestError as err:
                code, message = grpc.StatusCode.INVALID_ARGUMENT, str(err)
                logger.warning(f"{rpc}: invalid request: {message}")
            except BatchNotFoundError as err:
                code, message = grpc.StatusCode.NOT_FOUND, str(err)
                logger.warning(f"{rpc}: {message}")
            except Exception as err:  # noqa: BLE001 - every engine failure becomes INTERNAL
                code, message = grpc.StatusCode.INTERNAL, str(err) or type(err).__name__
                logger.opt(exception=err).error(f"{rpc} failed: {message}")
        await context.abort(code, message)
        raise AssertionError("unreachable: context.abort raises")

    async def _in_worker(self, work: Callable[[], T]) -> T:
        def locked() -> T:
            with self._engine_lock:
                return work()

        # Copy the context so tracing spans opened by an interceptor stay current in the worker.
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._executor, ctx.run, locked)
