"""``Router``: the stock TGI v3 router's side of the gRPC conversation, replayed in Python.

Startup, exactly as ``connect_backend`` + ``main``: connect ``{uds_base_path}-0`` →
``ServiceDiscovery`` → connect every URL (``unix://`` stripped) → ``ClearCache(None)`` → ``Info``
(last shard) → ``Warmup`` (the router's warmup batch, min tuple over shards) → limit derivation and
the router's startup checks → queue, allocator and batching task. Then ``generate`` schedules
requests the way the stock ``Infer``/validation layers do, and ``health`` answers like ``/health``.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any

from .batching import Batcher, BatchingConfig
from .client import ClientError, ShardedClient
from .datatypes import Entry, Failure, GenerateParameters, ResponseChannel, ValidRequest
from .errors import OverloadedError, RouterFatalError, RouterStartupError, ValidationError
from .images import placeholder_rule_for
from .info import RouterInfo, RouterStats
from .queue import Queue
from .stream import GenerationStream
from .validation import ValidationLimits, Validator, load_tokenizer


def derive_limits(
    answer: tuple[int | None, int, int],
    *,
    max_input_tokens: int | None,
    max_total_tokens: int | None,
    max_batch_prefill_tokens: int,
    max_batch_total_tokens: int | None,
) -> tuple[int, int, int]:
    """``(max_batch_total_tokens, max_input_tokens, max_total_tokens)`` from the Warmup answer."""
    supported, shard_input, shard_total = answer
    if max_input_tokens is not None and max_input_tokens != shard_input:
        raise RouterStartupError(
            f"assertion `left == right` failed: --max-input-tokens {max_input_tokens} != "
            f"Warmup max_input_tokens {shard_input} (the router panics)"
        )
    if max_total_tokens is not None and max_total_tokens != shard_total:
        raise RouterStartupError(
            f"assertion `left == right` failed: --max-total-tokens {max_total_tokens} != "
            f"Warmup max_total_tokens {shard_total} (the router panics)"
        )
    if supported is None:
        total = max_batch_total_tokens
        if total is None:
            total = max(16000, shard_total, max_batch_prefill_tokens)
        return total, shard_input, shard_total
    if shard_total > supported:
        raise RouterStartupError(f"Backend failed: Not enough memory to handle `max_total_tokens={shard_total}`")
    return supported, shard_input, shard_total


def check_startup_args(
    max_input_tokens: int,
    max_total_tokens: int,
    max_batch_prefill_tokens: int,
    max_batch_total_tokens: int,
    support_chunking: bool,
) -> None:
    """The stock ``main`` argument checks once the backend is known."""

    def fail(message: str) -> None:
        raise RouterStartupError(f"Argument validation error: {message}")

    if max_input_tokens >= max_total_tokens:
        fail("`max_input_tokens` must be < `max_total_tokens`")
    if max_input_tokens > max_batch_prefill_tokens and not support_chunking:
        fail(
            "`max_batch_prefill_tokens` must be >= `max_input_tokens`. "
            f"Given: {max_batch_prefill_tokens} and {max_input_tokens}"
        )
    if max_batch_prefill_tokens > max_batch_total_tokens:
        fail(
            "`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. "
            f"Given: {max_batch_prefill_tokens} and {max_batch_total_tokens}"
        )
    if max_total_tokens > max_batch_total_tokens:
        fail(
            "`max_total_tokens` must be <= `max_batch_total_tokens`. "
            f"Given: {max_total_tokens} and {max_batch_total_tokens}"
        )


class Router:
    """Create with :meth:`connect`; see the package docstring for the API."""

    def __init__(
        self, client: ShardedClient, info: RouterInfo, tokenizer: Any, strict: bool, image_rule: Any = None
    ) -> None:
        self._client = client
        self.info = info
        self.tokenizer = tokenizer
        self.strict = strict
        self._stats = RouterStats()
        self._validator = Validator(
            tokenizer, ValidationLimits(info.max_input_tokens, info.max_total_tokens), image_rule
        )
        self._queue = Queue(
            requires_padding=info.requires_padding,
            block_size=info.block_size,
            prefix_caching=info.use_prefix_caching,
            window_size=info.window_size,
            speculate=info.speculate,
            max_batch_total_tokens=info.max_batch_total_tokens,
            support_chunking=info.support_chunking,
        )
        self._batcher = Batcher(
            client,
            self._queue,
            BatchingConfig(
                waiting_served_ratio=info.waiting_served_ratio,
                max_batch_prefill_tokens=info.max_batch_prefill_tokens,
                max_batch_total_tokens=info.max_batch_total_tokens,
                max_waiting_tokens=info.max_waiting_tokens,
                max_batch_size=info.max_batch_size,
                support_chunking=info.support_chunking,
                strict=strict,
            ),
            self._stats,
        )
        self._batcher.on_fatal = self._on_fatal
        self._permits = info.max_concurrent_requests
        self._backend_healthy = True
        self._channels: weakref.WeakSet[ResponseChannel] = weakref.WeakSet()
        self.fatal_error: RouterFatalError | None = None
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._batcher.run(), name="router-replay-batching")

    # -- startup -----------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        uds_base_path: str,
        tokenizer: Any,
        *,
        max_input_tokens: int | None = None,
        max_total_tokens: int | None = None,
        max_batch_prefill_tokens: int = 4096,
        max_batch_total_tokens: int | None = None,
        max_batch_size: int | None = None,
        waiting_served_ratio: float = 1.2,
        max_waiting_tokens: int = 20,
        max_concurrent_requests: int = 128,
        strict: bool = True,
        send_traceparent: bool = False,
    ) -> Router:
        """Run the stock startup against ``{uds_base_path}-0``; raises ``RouterStartupError``.

        ``tokenizer``: a model directory (loaded with ``AutoTokenizer``) or a tokenizer object.
        ``strict=False`` keeps only the stock router's own panics fatal (see ``batching``).
        """
        if max_batch_size is not None and max_batch_size == 0:
            raise RouterStartupError("Argument validation error: `max_batch_size` must be > 0")
        try:
            client = await ShardedClient.connect_uds(f"{uds_base_path}-0", send_traceparent=send_traceparent)
        except ClientError as err:
            raise RouterStartupError(f"Backend failed: Unable to connect to the Python model shards: {err}") from err
        try:
            return await cls._start(
                client, tokenizer, max_input_tokens, max_total_tokens, max_batch_prefill_tokens,
                max_batch_total_tokens, max_batch_size, waiting_served_ratio, max_waiting_tokens,
                max_concurrent_requests, strict,
            )  # fmt: skip
        except BaseException:
            await client.close()
            raise

    @classmethod
    async def _start(
        cls, client: ShardedClient, tokenizer: Any, max_input_tokens: int | None, max_total_tokens: int | None,
        max_batch_prefill_tokens: int, max_batch_total_tokens: int | None, max_batch_size: int | None,
        waiting_served_ratio: float, max_waiting_tokens: int, max_concurrent_requests: int, strict: bool,
    ) -> Router:  # fmt: skip
        async def step(what: str, coro: Any) -> Any:
            try:
                return await coro
            except ClientError as err:
                raise RouterStartupError(f"Backend failed: Unable to {what}: {err}") from err

        await step("clear the Python model shards cache", client.clear_cache(None))
        shard_info = await step("get the Python model shards info", client.info())
        answer = await step(
            "warmup the Python model shards",
            client.warmup(max_input_tokens, max_batch_prefill_tokens, max_total_tokens, max_batch_size),
        )
        total, input_tokens, total_tokens = derive_limits(
            answer,
            max_input_tokens=max_input_tokens,
            max_total_tokens=max_total_tokens,
            max_batch_prefill_tokens=max_batch_prefill_tokens,
            max_batch_total_tokens=max_batch_total_tokens,
        )
        if shard_info.block_size < 1:
            # The stock router would divide by zero in its queue task and then hang every request.
            raise RouterStartupError("Info.block_size must be >= 1 (the stock router's queue task panics on 0)")
        check_startup_args(input_tokens, total_tokens, max_batch_prefill_tokens, total, shard_info.support_chunking)
        info = RouterInfo(
            max_batch_total_tokens=total,
            max_input_tokens=input_tokens,
            max_total_tokens=total_tokens,
            max_batch_prefill_tokens=max_batch_prefill_tokens,
            max_batch_size=max_batch_size,
            waiting_served_ratio=waiting_served_ratio,
            max_waiting_tokens=max_waiting_tokens,
            max_concurrent_requests=max_concurrent_requests,
            max_supported_total_tokens=answer[0],
            num_blocks=total // shard_info.block_size,
            requires_padding=shard_info.requires_padding,
            dtype=shard_info.dtype,
            device_type=shard_info.device_type,
            window_size=shard_info.window_size if shard_info.HasField("window_size") else None,
            speculate=shard_info.speculate,
            support_chunking=shard_info.support_chunking,
            use_prefix_caching=shard_info.use_prefix_caching,
            attention_impl=shard_info.attention_impl,
            block_size=shard_info.block_size,
            shard_urls=tuple(client.urls),
        )
        image_rule = await asyncio.to_thread(placeholder_rule_for, tokenizer)  # a VLM's images become chunks
        return cls(client, info, await asyncio.to_thread(load_tokenizer, tokenizer), strict, image_rule)

    # -- requests ----------------------------------------------------------------------------

    async def generate(self, inputs: str, params: GenerateParameters | None = None) -> GenerationStream:
        """Validate and schedule one request; returns its event stream.

        Raises ``OverloadedError`` (no concurrency permit), ``ValidationError``, or the router's
        ``RouterFatalError`` if the batching task already died.
        """
        self._raise_if_unusable()
        params = params if params is not None else GenerateParameters()
        if self._permits <= 0:
            self._stats.overloaded += 1
            raise OverloadedError()
        self._permits -= 1
        try:
            valid = await self._validator.validate(inputs, params)
            self._raise_if_unusable()
        except BaseException as err:
            self._permits += 1
            if isinstance(err, ValidationError):
                self._stats.validation_errors += 1
            raise
        request_id, channel = self._schedule(valid)
        return GenerationStream(self, inputs, params, valid, request_id, channel)

    def _schedule(self, valid: ValidRequest, continuation: bool = False) -> tuple[int, ResponseChannel]:
        channel = ResponseChannel()
        if self.fatal_error is not None:
            channel.send(Failure(self.fatal_error))
            channel.drop_sender()
            return -1, channel
        request_id = self._queue.append(Entry(valid, channel, time.monotonic()))
        self._channels.add(channel)
        self._stats.requests_scheduled += 1
        if continuation:
            self._stats.continuation_legs += 1
        self._stats.queue_peak = max(self._stats.queue_peak, len(self._queue))
        self._batcher.notify()
        return request_id, channel

    def _release_permit(self) -> None:
        self._permits += 1

    def _raise_if_unusable(self) -> None:
        if self.fatal_error is not None:
            raise self.fatal_error
        if self._closed:
            raise RuntimeError("router replay is closed")

    def _on_fatal(self, err: RouterFatalError) -> None:
        self.fatal_error = err
        for channel in list(self._channels):
            if not channel.sender_dropped:
                channel.send(Failure(err))
                channel.drop_sender()

    # -- health, state, shutdown ---------------------------------------------------------------

    async def health(self) -> bool:
        """``/health``: the ``Health`` RPC while healthy, else the liveness ``Prefill``.

        Any generation error delivered to a client marks the backend unhealthy (stock ``Infer``).
        """
        self._raise_if_unusable()
        if self._backend_healthy:
            self._stats.health_calls += 1
            try:
                await self._client.health()
                healthy = True
            except ClientError:
                healthy = False
        else:
            self._stats.liveness_calls += 1
            try:
                kept = await self._client.model_health()
                healthy = True
            except ClientError:
                healthy, kept = False, None
            if kept is not None and self.strict:
                raise RouterFatalError(
                    "liveness_batch_kept",
                    f"the liveness Prefill returned CachedBatch {kept.id}; the router never clears it",
                )
        self._backend_healthy = healthy
        return healthy

    @property
    def backend_healthy(self) -> bool:
        return self._backend_healthy

    @property
    def stats(self) -> RouterStats:
        self._stats.queue_length = len(self._queue)
        self._stats.queue_blocked_on_kv = bool(self._queue.entries) and self._queue.stop_reason == "kv"
        self._stats.requests_dropped_at_pop = self._queue.dropped
        return self._stats

    @property
    def rpc_log(self) -> list[tuple[str, Any]]:
        """Every fan-out RPC in order, startup included: ``(method, request message)``."""
        return self._client.calls

    @property
    def free_blocks(self) -> int:
        allocator = self._queue.allocator
        return allocator.free_block_count() if allocator is not None else 0

    async def close(self, *, raise_fatal: bool = True) -> None:
        """Stop the batching task and close the shard connections.

        Re-raises the fatal error, if one happened, unless ``raise_fatal=False``.
        """
        if not self._closed:
            self._closed = True
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            for channel in list(self._channels):
                channel.drop_sender()
            await self._client.close()
        if raise_fatal and self.fatal_error is not None:
            raise self.fatal_error

    async def __aenter__(self) -> Router:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(raise_fatal=exc[0] is None)
