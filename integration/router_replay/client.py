"""The stock v3 router's gRPC client: one connection per shard, every RPC fanned out to all shards.

Merging rules of the stock sharded client, kept here:

* ``Info``, ``Health``, ``FilterBatch``: every shard is called, only the **last** shard's answer
  (or error) counts;
* ``ClearCache``, ``Warmup``, ``Prefill``, ``Decode``: the first error in shard order wins;
* ``Warmup``: the minimum ``(max_supported_total_tokens, max_input_tokens, max_total_tokens)``
  tuple, with ``None`` below any value;
* ``Prefill``/``Decode``: the last shard's ``CachedBatch``; generations = the last shard's list
  followed by the others' in shard order.

Every gRPC status becomes ``ClientError`` with the stock display (``Server error: <message>``).
Responses are limited to 4 MiB like tonic's default decoder; a larger one is flagged ``too_large``.
No deadlines. An optional W3C ``traceparent`` rides in the metadata of every call.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import grpc

from tgi_paged_backend.server.pb import generate_pb2 as pb
from tgi_paged_backend.server.pb import generate_pb2_grpc as pb_grpc

from .errors import client_error_message

MAX_RESPONSE_BYTES = 4 * 1024 * 1024
U64_MAX = 2**64 - 1
U32 = 0xFFFFFFFF


class ClientError(Exception):
    """The stock ``ClientError``: ``str()`` is its display text."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.too_large = too_large


def _png_20x20() -> bytes:
    """A tiny 20x20 RGB PNG, for the warmup image chunk."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    rows = b"".join(b"\x00" + b"\x80\x80\x80" * 20 for _ in range(20))
    header = struct.pack(">IIBBBBB", 20, 20, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


WARMUP_IMAGE = _png_20x20()
WARMUP_IMAGE_BASE64 = base64.b64encode(WARMUP_IMAGE).decode()


def build_warmup_request(
    max_input_tokens: int | None,
    max_prefill_tokens: int,
    max_total_tokens: int | None,
    max_batch_size: int | None,
) -> pb.WarmupRequest:
    """The router's warmup batch: ``"_test "`` prompts whose ``truncate`` values sum to the prefill budget."""
    requests = []
    n_tokens = 0
    while n_tokens < max_prefill_tokens:
        truncate = max_prefill_tokens - n_tokens
        if max_input_tokens is not None:
            truncate = min(max_input_tokens, truncate)
        text = "_test " * truncate
        chunks = [pb.InputChunk(text=text)]
        inputs = text
        if n_tokens == 0:
            # One request with an image is enough to exercise vision heads.
            chunks.append(pb.InputChunk(image=pb.Image(data=WARMUP_IMAGE, mimetype="image/jpeg;base64")))
            inputs += f"![](data:image/jpeg;base64,{WARMUP_IMAGE_BASE64})"
        # u32 arithmetic, as in the stock client (wraps if truncate > max_total_tokens).
        max_new_tokens = (max_total_tokens - truncate) & U32 if max_total_tokens is not None else 1
        requests.append(
            pb.Request(
                id=0,
                inputs=inputs,
                input_chunks=pb.Input(chunks=chunks),
                truncate=truncate,
                add_special_tokens=True,
                blocks=[],
                slots=[],
                cache_len=0,
                parameters=pb.NextTokenChooserParameters(
                    temperature=0.9,
                    top_k=10,
                    top_p=0.9,
                    typical_p=0.9,
                    do_sample=False,
                    seed=0,
                    repetition_penalty=1.2,
                    frequency_penalty=0.1,
                    watermark=True,
                    grammar="",
                    grammar_type=pb.GRAMMAR_TYPE_NONE,
                ),
                stopping_parameters=pb.StoppingCriteriaParameters(
                    max_new_tokens=max_new_tokens, stop_sequences=[], ignore_eos_token=True
                ),
                prefill_logprobs=True,
                top_n_tokens=20,
            )
        )
        n_tokens += truncate
        if max_batch_size is not None and len(requests) == max_batch_size:
            break
    batch = pb.Batch(id=0, requests=requests, size=len(requests), max_tokens=max_input_tokens or 0, max_blocks=0)
    request = pb.WarmupRequest(batch=batch, max_prefill_tokens=max_prefill_tokens)
    if max_input_tokens is not None:
        request.max_input_tokens = max_input_tokens
    if max_total_tokens is not None:
        request.max_total_tokens = max_total_tokens
    return request


def build_liveness_batch() -> pb.Batch:
    """The router's model-health probe: one token of ``"liveness"`` into block 0 / slot 0."""
    request = pb.Request(
        id=U64_MAX,
        inputs="liveness",
        input_chunks=pb.Input(chunks=[pb.InputChunk(text="liveness")]),
        truncate=1,
        add_special_tokens=False,
        prefill_logprobs=False,
        parameters=pb.NextTokenChooserParameters(
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            typical_p=1.0,
            do_sample=False,
            seed=0,
            repetition_penalty=1.0,
            frequency_penalty=0.0,
            watermark=False,
            grammar="",
            grammar_type=pb.GRAMMAR_TYPE_NONE,
        ),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1, stop_sequences=[], ignore_eos_token=False),
        top_n_tokens=0,
        blocks=[0],
        slots=[0],
        cache_len=0,
    )
    return pb.Batch(id=U64_MAX, requests=[request], size=1, max_tokens=2, max_blocks=1)


def new_traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


class ShardClient:
    """One shard connection (``unix:`` socket, insecure HTTP/2)."""

    def __init__(self, path: str, channel: grpc.aio.Channel, send_traceparent: bool) -> None:
        self.path = path
        self.channel = channel
        self.stub = pb_grpc.TextGenerationServiceStub(channel)
        self.send_traceparent = send_traceparent

    @classmethod
    async def connect_uds(cls, path: str, *, send_traceparent: bool = False) -> ShardClient:
        # tonic's connector opens the socket eagerly and fails at once; grpc would retry forever.
        try:
            _, writer = await asyncio.open_unix_connection(path)
            writer.close()
            await writer.wait_closed()
        except OSError as err:
            raise ClientError(f"Could not connect to Text Generation server: {err}") from err
        channel = grpc.aio.insecure_channel(
            f"unix:{path}",
            options=[
                ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
                ("grpc.max_send_message_length", -1),
            ],
        )
        return cls(path, channel, send_traceparent)

    async def call(self, method: str, request: Any) -> Any:
        metadata = (("traceparent", new_traceparent()),) if self.send_traceparent else None
        try:
            return await getattr(self.stub, method)(request, metadata=metadata)
        except grpc.aio.AioRpcError as err:
            details = err.details() or ""
            too_large = err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
            raise ClientError(client_error_message(details), too_large=too_large) from err

    async def close(self) -> None:
        await self.channel.close()


def _first_error(results: Sequence[Any]) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _batch_or_none(response: Any) -> pb.CachedBatch | None:
    return response.batch if response.HasField("batch") else None


class ShardedClient:
    """All shards behind the stock ``ShardedClient`` semantics. ``calls`` logs every fan-out."""

    def __init__(self, clients: list[ShardClient]) -> None:
        self.clients = clients
        self.calls: list[tuple[str, Any]] = []

    @property
    def urls(self) -> list[str]:
        return [c.path for c in self.clients]

    @classmethod
    async def connect_uds(cls, master_path: str, *, send_traceparent: bool = False) -> ShardedClient:
        master = await ShardClient.connect_uds(master_path, send_traceparent=send_traceparent)
        try:
            try:
                response = await master.stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())
            except grpc.aio.AioRpcError as err:
                raise ClientError("Server does not support v3 interface") from err
            paths = [u[len("unix://") :] if u.startswith("unix://") else u for u in response.urls]
        finally:
            await master.close()
        connected = await asyncio.gather(
            *(ShardClient.connect_uds(p, send_traceparent=send_traceparent) for p in paths),
            return_exceptions=True,
        )
        try:
            _first_error(connected)
        except BaseException:
            await asyncio.gather(*(c.close() for c in connected if isinstance(c, ShardClient)))
            raise
        sharded = cls(list(connected))
        sharded.calls.append(("ServiceDiscovery", list(response.urls)))
        return sharded

    async def _fan_out(self, method: str, request: Any) -> list[Any]:
        self.calls.append((method, request))
        return list(await asyncio.gather(*(c.call(method, request) for c in self.clients), return_exceptions=True))

    async def _last(self, method: str, request: Any) -> Any:
        results = await self._fan_out(method, request)
        _first_error(results[-1:])
        return results[-1]

    async def info(self) -> pb.InfoResponse:
        return await self._last("Info", pb.InfoRequest())

    async def health(self) -> None:
        await self._last("Health", pb.HealthRequest())

    async def clear_cache(self, batch_id: int | None) -> None:
        request = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        _first_error(await self._fan_out("ClearCache", request))

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch | None:
        request = pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids)
        return _batch_or_none(await self._last("FilterBatch", request))

    async def warmup(
        self,
        max_input_tokens: int | None,
        max_prefill_tokens: int,
        max_total_tokens: int | None,
        max_batch_size: int | None,
    ) -> tuple[int | None, int, int]:
        request = build_warmup_request(max_input_tokens, max_prefill_tokens, max_total_tokens, max_batch_size)
        results = await self._fan_out("Warmup", request)
        _first_error(results)
        answers = [
            (
                r.max_supported_total_tokens if r.HasField("max_supported_total_tokens") else None,
                r.max_input_tokens,
                r.max_total_tokens,
            )
            for r in results
        ]
        return min(answers, key=lambda a: (a[0] is not None, a[0] or 0, a[1], a[2]))

    async def _step(self, method: str, request: Any) -> tuple[list[pb.Generation], pb.CachedBatch | None]:
        results = await self._fan_out(method, request)
        _first_error(results)
        *others, last = results
        generations = list(last.generations)
        for response in others:
            generations.extend(response.generations)
        return generations, _batch_or_none(last)

    async def prefill(
        self, batch: pb.Batch, cached_batch: pb.CachedBatch | None
    ) -> tuple[list[pb.Generation], pb.CachedBatch | None]:
        request = pb.PrefillRequest(batch=batch)
        if cached_batch is not None:
            request.cached_batch.CopyFrom(cached_batch)
        return await self._step("Prefill", request)

    async def decode(self, batches: list[pb.CachedBatch]) -> tuple[list[pb.Generation], pb.CachedBatch | None]:
        return await self._step("Decode", pb.DecodeRequest(batches=batches))

    async def model_health(self) -> pb.CachedBatch | None:
        """The liveness ``Prefill``; returns the batch the shard (wrongly) kept, if any."""
        _, batch = await self.prefill(build_liveness_batch(), None)
        return batch

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
