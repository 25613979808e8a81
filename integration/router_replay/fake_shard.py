"""A minimal, deterministic in-process ``generate.v3`` shard for router-replay tests.

It implements the eight RPCs with the stock shard's *semantics* (batch cache keyed by id, concat on
Decode and on chunked Prefill, FilterBatch re-caching under the same id, ClearCache tolerant of unknown
ids, finished requests kept in ``CachedBatch`` until filtered, ``batch = None`` when all finished,
no Generation while a request is still prefilling, one Generation per request per step emitted by
rank ``id % world_size`` only) and a trivial "model": the k-th generated token of every request is
the letter ``"abc...z"[k % 26]``.

Tests break it on purpose with ``fail_next`` (make the next call of a method fail with INTERNAL) or
``mutate`` (rewrite any response before it is sent). ``calls`` logs ``(method, request)`` in order.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from tgi_paged_backend.server.pb import generate_pb2 as pb
from tgi_paged_backend.server.pb import generate_pb2_grpc as pb_grpc

from .validation import encode

LETTERS = "abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """One token per character (id ``ord(c) + 2``), BOS = 1 when ``add_special_tokens``."""

    bos_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) + 2 for c in text]
        return [self.bos_id, *ids] if add_special_tokens else ids

    def decode_one(self, token_id: int) -> str:
        return "<s>" if token_id == self.bos_id else chr(token_id - 2)


@dataclass
class FakeShardConfig:
    block_size: int = 16
    support_chunking: bool = False
    use_prefix_caching: bool = False
    requires_padding: bool = False
    speculate: int = 0
    window_size: int | None = None
    max_supported_total_tokens: int | None = 4096
    default_max_total_tokens: int = 1024
    """Warmup answer when the router sent no ``max_total_tokens`` (``max_input_tokens`` = this − 1)."""
    eos_after: int | None = None
    """Finish with EOS after this many tokens (unless ``ignore_eos_token``)."""
    eos_id: int = 0
    attention_impl: str = "paged"


@dataclass
class FakeRequest:
    id: int
    prompt_ids: list[int]
    computed: int
    next_chunk: int | None
    max_new_tokens: int
    prefill_logprobs: bool
    top_n_tokens: int
    do_sample: bool
    seed: int
    ignore_eos: bool
    blocks: list[int]
    generated: int = 0
    finished: bool = False
    text: str = ""

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt_ids)


@dataclass
class FakeShard:
    """One rank. ``await start()`` binds ``{uds_base_path}-{rank}``; ``await stop()`` closes it."""

    uds_base_path: str
    config: FakeShardConfig = field(default_factory=FakeShardConfig)
    rank: int = 0
    world_size: int = 1
    tokenizer: Any = field(default_factory=CharTokenizer)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    batches: dict[int, list[FakeRequest]] = field(default_factory=dict)
    fail_next: dict[str, str] = field(default_factory=dict)
    mutate: Callable[[str, Any, Any], Any] | None = None
    max_prefill_tokens: int = 4096
    violations: list[str] = field(default_factory=list)
    hold: dict[int, int] = field(default_factory=dict)
    """request id -> number of steps it sits out (no compute, no Generation), like a preempted request."""
    pause: dict[str, Any] = field(default_factory=dict)
    """method -> ``asyncio.Event``: calls of that method (logged first) wait until it is set."""
    """Router-side contract breaches the shard noticed (block 0 handed out, wrong slot count, ...)."""

    @property
    def socket_path(self) -> str:
        return f"{self.uds_base_path}-{self.rank}"

    async def start(self) -> None:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", 2**31 - 1)])
        pb_grpc.add_TextGenerationServiceServicer_to_server(_Servicer(self), self._server)
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(grace=None)

    def methods(self) -> list[str]:
        return [method for method, _ in self.calls]

    # -- model -------------------------------------------------------------------------------

    def _admit(self, request: pb.Request) -> FakeRequest:
        text = next((c.text for c in request.input_chunks.chunks if c.WhichOneof("chunk") == "text"), "")
        ids = encode(self.tokenizer, text, request.add_special_tokens)[-request.truncate :]
        stopping = request.stopping_parameters
        if request.blocks:
            if 0 in request.blocks and request.id != 2**64 - 1:
                self.violations.append(f"request {request.id} was given block 0")
            expected = len(ids) + stopping.max_new_tokens + self.config.speculate - 1
            if len(request.slots) != expected:
                self.violations.append(f"request {request.id}: {len(request.slots)} slots, expected {expected}")
        remaining = len(ids) - request.cache_len
        return FakeRequest(
            id=request.id,
            prompt_ids=ids,
            computed=request.cache_len,
            next_chunk=request.chunk_len if request.HasField("chunk_len") else remaining,
            max_new_tokens=stopping.max_new_tokens,
            prefill_logprobs=request.prefill_logprobs,
            top_n_tokens=request.top_n_tokens,
            do_sample=request.parameters.do_sample,
            seed=request.parameters.seed,
            ignore_eos=stopping.ignore_eos_token,
            blocks=list(request.blocks),
        )

    def _decode(self, token_id: int) -> str:
        if hasattr(self.tokenizer, "decode_one"):
            return self.tokenizer.decode_one(token_id)
        return self.tokenizer.decode([token_id])

    def _token(self, req: FakeRequest) -> tuple[int, str]:
        if self.config.eos_after is not None and not req.ignore_eos and req.generated == self.config.eos_after:
            return self.config.eos_id, "</s>"
        letter = LETTERS[req.generated % 26]
        return ord(letter) + 2, letter

    def _step(self, requests: list[FakeRequest]) -> list[pb.Generation]:
        live = [r for r in requests if not r.finished]
        budget = self.max_prefill_tokens - (len(live) - 1)
        generations = []
        for req in live:
            if self.hold.get(req.id, 0) > 0:
                self.hold[req.id] -= 1
                continue
            if req.prefilling:
                remaining = len(req.prompt_ids) - req.computed
                n = req.next_chunk if req.next_chunk is not None else min(remaining, max(1, budget))
                req.next_chunk = None
                budget -= n
                req.computed += n
                if req.prefilling:
                    continue
                prefill = req.prefill_logprobs
            else:
                prefill = False
            token_id, text = self._token(req)
            req.generated += 1
            req.text += text if token_id != self.config.eos_id else ""
            generation = pb.Generation(
                request_id=req.id,
                tokens=pb.Tokens(
                    ids=[token_id], logprobs=[-0.5], texts=[text], is_special=[token_id == self.config.eos_id]
                ),
            )
            if prefill:
                ids = req.prompt_ids
                generation.prefill_tokens.CopyFrom(
                    pb.Tokens(ids=ids, logprobs=[math.nan] + [-1.0] * (len(ids) - 1),
                              texts=[self._decode(i) for i in ids])
                )  # fmt: skip
            if req.top_n_tokens:
                generation.top_tokens.append(
                    pb.Tokens(ids=[token_id] * req.top_n_tokens, logprobs=[-0.5] * req.top_n_tokens,
                              texts=[text] * req.top_n_tokens, is_special=[False] * req.top_n_tokens)
                )  # fmt: skip
            reason = None
            if req.generated >= req.max_new_tokens:
                reason = pb.FINISH_REASON_LENGTH
            elif token_id == self.config.eos_id:
                reason = pb.FINISH_REASON_EOS_TOKEN
            if reason is not None:
                req.finished = True
                final = pb.GeneratedText(text=req.text, generated_tokens=req.generated, finish_reason=reason)
                if req.do_sample:
                    final.seed = req.seed
                generation.generated_text.CopyFrom(final)
            if req.id % self.world_size == self.rank:
                generations.append(generation)
        return generations

    def _cache(self, batch_id: int, requests: list[FakeRequest]) -> pb.CachedBatch | None:
        if all(r.finished for r in requests):
            self.batches.pop(batch_id, None)
            return None
        self.batches[batch_id] = requests
        return self._cached(batch_id, requests)

    def _cached(self, batch_id: int, requests: list[FakeRequest]) -> pb.CachedBatch:
        live = [r for r in requests if not r.finished]
        current = sum(min(len(r.prompt_ids) - r.computed, self.max_prefill_tokens) if r.prefilling else 1 for r in live)
        return pb.CachedBatch(
            id=batch_id,
            request_ids=[r.id for r in requests],
            size=len(requests),
            max_tokens=sum(len(r.blocks) for r in requests) * self.config.block_size,
            current_tokens=current,
        )

    # -- RPC bodies (return a response or raise ValueError -> INTERNAL) ------------------------

    def info(self, request: pb.InfoRequest) -> pb.InfoResponse:
        c = self.config
        response = pb.InfoResponse(
            requires_padding=c.requires_padding, dtype="float32", device_type="cpu", speculate=c.speculate,
            support_chunking=c.support_chunking, use_prefix_caching=c.use_prefix_caching,
            attention_impl=c.attention_impl, block_size=c.block_size,
        )  # fmt: skip
        if c.window_size is not None:
            response.window_size = c.window_size
        return response

    def service_discovery(self, request: pb.ServiceDiscoveryRequest) -> pb.ServiceDiscoveryResponse:
        return pb.ServiceDiscoveryResponse(urls=[f"unix://{self.uds_base_path}-{r}" for r in range(self.world_size)])

    def clear_cache(self, request: pb.ClearCacheRequest) -> pb.ClearCacheResponse:
        if request.HasField("id"):
            self.batches.pop(request.id, None)
        else:
            self.batches.clear()
        return pb.ClearCacheResponse()

    def filter_batch(self, request: pb.FilterBatchRequest) -> pb.FilterBatchResponse:
        requests = self.batches.pop(request.batch_id, None)
        if requests is None:
            raise ValueError(f"Batch ID {request.batch_id} not found in cache.")
        keep = set(request.request_ids)
        kept = [r for r in requests if r.id in keep]
        self.batches[request.batch_id] = kept
        return pb.FilterBatchResponse(batch=self._cached(request.batch_id, kept))

    def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        self.max_prefill_tokens = request.max_prefill_tokens
        total = self.config.default_max_total_tokens
        if request.HasField("max_total_tokens"):
            total = request.max_total_tokens
        max_input = request.max_input_tokens if request.HasField("max_input_tokens") else total - 1
        response = pb.WarmupResponse(max_input_tokens=max_input, max_total_tokens=total)
        if self.config.max_supported_total_tokens is not None:
            response.max_supported_total_tokens = self.config.max_supported_total_tokens
        return response

    def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        if not request.batch.requests:
            raise ValueError("Batch must have at least one request")
        new = [self._admit(r) for r in request.batch.requests]
        batch_id = request.batch.id
        if self.config.support_chunking and request.HasField("cached_batch"):
            cached = self.batches.pop(request.cached_batch.id, None)
            if cached is None:
                raise ValueError(f"Batch ID {request.cached_batch.id} not found in cache.")
            new, batch_id = cached + new, request.cached_batch.id
        generations = self._step(new)
        batch = self._cache(batch_id, new)
        response = pb.PrefillResponse(generations=generations)
        if batch is not None:
            response.batch.CopyFrom(batch)
        return response

    def decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        if not request.batches:
            raise ValueError("Must provide at least one batch")
        merged: list[FakeRequest] = []
        for cached in request.batches:
            requests = self.batches.pop(cached.id, None)
            if requests is None:
                raise ValueError(f"Batch ID {cached.id} not found in cache.")
            merged.extend(requests)
        generations = self._step(merged)
        batch = self._cache(request.batches[0].id, merged)
        response = pb.DecodeResponse(generations=generations)
        if batch is not None:
            response.batch.CopyFrom(batch)
        return response

    def health(self, request: pb.HealthRequest) -> pb.HealthResponse:
        return pb.HealthResponse()


class _Servicer(pb_grpc.TextGenerationServiceServicer):
    def __init__(self, shard: FakeShard) -> None:
        self.shard = shard

    async def _handle(self, method: str, body: Callable[[Any], Any], request: Any, context: Any) -> Any:
        shard = self.shard
        shard.calls.append((method, request))
        gate = shard.pause.get(method)
        if gate is not None:
            await gate.wait()
        message = shard.fail_next.pop(method, None)
        if message is not None:
            await context.abort(grpc.StatusCode.INTERNAL, message)
        try:
            response = body(request)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INTERNAL, str(err))
        if shard.mutate is not None:
            response = shard.mutate(method, request, response)
        return response

    async def Info(self, request, context):  # noqa: N802 (gRPC method names)
        return await self._handle("Info", self.shard.info, request, context)

    async def ServiceDiscovery(self, request, context):  # noqa: N802
        return await self._handle("ServiceDiscovery", self.shard.service_discovery, request, context)

    async def ClearCache(self, request, context):  # noqa: N802
        return await self._handle("ClearCache", self.shard.clear_cache, request, context)

    async def FilterBatch(self, request, context):  # noqa: N802
        return await self._handle("FilterBatch", self.shard.filter_batch, request, context)

    async def Warmup(self, request, context):  # noqa: N802
        return await self._handle("Warmup", self.shard.warmup, request, context)

    async def Prefill(self, request, context):  # noqa: N802
        return await self._handle("Prefill", self.shard.prefill, request, context)

    async def Decode(self, request, context):  # noqa: N802
        return await self._handle("Decode", self.shard.decode, request, context)

    async def Health(self, request, context):  # noqa: N802
        return await self._handle("Health", self.shard.health, request, context)


@contextlib.asynccontextmanager
async def fake_shards(
    config: FakeShardConfig | None = None, *, world_size: int = 1, tokenizer: Any = None
) -> AsyncIterator[list[FakeShard]]:
    """``world_size`` started fake ranks on a short temporary base path (``shards[0].uds_base_path``)."""
    directory = tempfile.mkdtemp(prefix="rr", dir="/tmp")  # unix socket paths must stay short
    base = os.path.join(directory, "tgs")
    shards = [
        FakeShard(
            base, config or FakeShardConfig(), rank=rank, world_size=world_size, tokenizer=tokenizer or CharTokenizer()
        )  # fmt: skip
        for rank in range(world_size)
    ]
    try:
        for shard in shards:
            await shard.start()
        yield shards
    finally:
        for shard in shards:
            if hasattr(shard, "_server"):
                await shard.stop()
        shutil.rmtree(directory, ignore_errors=True)
