"""A live shard in this process, and the router's side of ``generate.v3`` around it.

:class:`LiveShard` builds the real :class:`PagedShardEngine` on a (tiny) model and serves it with the real
``grpc_server.serve`` on its own thread and event loop, on a unix socket, exactly as the CLI does (the
tracing interceptor included); calls go through the generated client stub. The engine object stays
reachable (``LiveShard.engine``) so a caller can read its memory books between RPCs: each RPC has
returned before the next one starts, and the servicer runs one engine call at a time.

:class:`RouterBooks` is what the v3 router knows: its cached batches, each request's reservation in the
virtual block space (``SimpleAllocator``: block 0 never handed out, ``slots = block * bs + offset``), the
tokens received. :meth:`RouterBooks.absorb` applies one RPC's outcome the way the router does (a failed
Prefill or Decode fails every request it sent) and checks the contract on the way:

- an RPC ends in a response or a gRPC status with a non-empty message;
- Generation shape rules (one token, up to ``1 + speculate``; four lists of equal length; finite
  log-probabilities; one Generation per request and response; ``generated_text`` once, at the end);
- no lost request: every request handed to a Prefill or Decode that succeeded either finished in that
  response or is listed in its ``CachedBatch``;
- the shard agrees with the router: the same cached batches with the same ids, no request in the shard
  that no batch owns, and the block books balance (``KVCacheManager.check_invariants``).

Shared by ``tests/server/test_rpc_fuzz.py`` and ``examples/soak.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tgi_paged_backend.server.pb import generate_pb2 as pb
from tgi_paged_backend.server.pb import generate_pb2_grpc as pb_grpc

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
EXPECTED_ERRORS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND})
"""Statuses bad router input may end in. ``INTERNAL`` means the engine failed inside a step (a bug to look
at); anything else (``UNKNOWN``, ``DEADLINE_EXCEEDED``) means the servicer did not map an error or hung."""


class ContractError(AssertionError):
    """The shard broke the ``generate.v3`` contract or its own books."""


# ---------------------------------------------------------------------------------------------- shard


def engine_config(model_dir: Path | str, env: dict[str, str], *, speculate: int = 0):
    """The engine's ``BackendConfig`` from env-style knobs (``os.environ`` is neither read nor changed)."""
    from tgi_paged_backend.envs import build_config
    from tgi_paged_backend.model_files import with_local_model

    return with_local_model(build_config({"model_id": str(model_dir), "speculate": speculate}, dict(env)))


class LiveShard:
    """``grpc_server.serve`` over a real engine on a thread of this process; ``stub`` talks to it."""

    def __init__(self, model_dir: Path | str, env: dict[str, str], *, speculate: int = 0, rpc_timeout_s: float = 120):
        self.config = engine_config(model_dir, env, speculate=speculate)
        self.rpc_timeout_s = rpc_timeout_s
        self._dir = tempfile.mkdtemp(prefix="tgis-", dir="/tmp")  # unix socket paths are short
        uds = os.path.join(self._dir, "shard")
        self.config = dataclasses.replace(self.config, server=dataclasses.replace(self.config.server, uds_path=uds))
        self.socket_path = f"{uds}-0"
        self.engine: Any = None
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="live-shard", daemon=True)
        self._channel: grpc.Channel | None = None
        self.stub: pb_grpc.TextGenerationServiceStub | None = None

    def start(self, timeout_s: float = 300.0) -> LiveShard:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.socket_path):
            if not self._thread.is_alive():
                raise RuntimeError(f"the shard stopped before serving: {self.error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError("the shard did not create its socket")
            time.sleep(0.02)
        self._channel = grpc.insecure_channel(
            f"unix://{self.socket_path}", options=[("grpc.max_receive_message_length", 2**31 - 1)]
        )
        self.stub = pb_grpc.TextGenerationServiceStub(self._channel)
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> int | None:
        if self._channel is not None:
            self._channel.close()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)
        return self.exit_code

    def __enter__(self) -> LiveShard:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        from tgi_paged_backend.engine import build_engine
        from tgi_paged_backend.server import grpc_server
        from tgi_paged_backend.server.tracing import TracingInterceptor

        def factory(config):
            self.engine = build_engine(config)
            return self.engine

        async def main() -> int:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            return await grpc_server.serve(
                self.config, factory, interceptors=[TracingInterceptor(None)], stop=self._stop, grace_s=1.0
            )

        try:
            self.exit_code = asyncio.run(main())
        except BaseException as err:  # noqa: BLE001 - reported by start() / the caller
            self.error = err

    # -- calls --------------------------------------------------------------------------------

    def call(self, rpc: str, message: Any) -> Outcome:
        """One unary RPC; the response or the status (a deadline means the shard hung)."""
        assert self.stub is not None, "start() first"
        try:
            return Outcome(response=getattr(self.stub, rpc)(message, timeout=self.rpc_timeout_s))
        except grpc.RpcError as err:
            return Outcome(code=err.code(), details=err.details() or "")


@dataclass
class Outcome:
    """An RPC's end: a response, or a status with its message."""

    response: Any = None
    code: grpc.StatusCode | None = None
    details: str = ""

    @property
    def ok(self) -> bool:
        return self.code is None


# ---------------------------------------------------------------------------------------------- messages


def chooser(
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    typical_p: float = 1.0,
    do_sample: bool = False,
    seed: int = 0,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    grammar: tuple[int, str] | None = None,
) -> pb.NextTokenChooserParameters:
    """``NextTokenChooserParameters`` with the router's defaults (greedy); ``grammar`` is ``(type, text)``."""
    params = pb.NextTokenChooserParameters(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        typical_p=typical_p,
        do_sample=do_sample,
        seed=seed,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
    )
    if grammar is not None:
        params.grammar_type, params.grammar = grammar
    return params


def text_request(
    request_id: int,
    text: str,
    *,
    max_new_tokens: int,
    truncate: int = 10_000,
    parameters: pb.NextTokenChooserParameters | None = None,
    stop_sequences: Sequence[str] = (),
    ignore_eos_token: bool = False,
    blocks: Sequence[int] = (),
    slots: Sequence[int] = (),
    **fields: Any,
) -> pb.Request:
    """A ``generate.v3.Request`` with one text chunk (the router's shape)."""
    return pb.Request(
        id=request_id,
        inputs=text,
        input_chunks=pb.Input(chunks=[pb.InputChunk(text=text)]),
        truncate=truncate,
        parameters=parameters if parameters is not None else chooser(),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new_tokens, stop_sequences=list(stop_sequences), ignore_eos_token=ignore_eos_token
        ),
        blocks=list(blocks),
        slots=list(slots),
        add_special_tokens=fields.pop("add_special_tokens", True),
        **fields,
    )


def prefill_message(batch_id: int, requests: Sequence[pb.Request], cached: int | None = None) -> pb.PrefillRequest:
    message = pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=list(requests), size=len(requests)))
    if cached is not None:
        message.cached_batch.CopyFrom(pb.CachedBatch(id=cached))
    return message


def decode_message(batch_ids: Iterable[int]) -> pb.DecodeRequest:
    return pb.DecodeRequest(batches=[pb.CachedBatch(id=b) for b in batch_ids])


def warmup(shard: LiveShard, *, max_input_tokens: int, max_total_tokens: int, max_prefill_tokens: int) -> Any:
    """The router's ``Warmup`` (``grpc_client.rs``: dummy prompts filling ``max_prefill_tokens``)."""
    requests, n = [], 0
    while n < max_prefill_tokens:
        truncate = min(max_prefill_tokens - n, max_input_tokens)
        requests.append(
            text_request(
                0,
                "_test " * truncate,
                truncate=truncate,
                max_new_tokens=max_total_tokens - truncate,
                ignore_eos_token=True,
                prefill_logprobs=True,
                top_n_tokens=20,
                parameters=chooser(
                    temperature=0.9, top_k=10, top_p=0.9, typical_p=0.9, repetition_penalty=1.2, frequency_penalty=0.1
                ),
            )
        )
        n += truncate
    message = pb.WarmupRequest(
        batch=pb.Batch(id=0, requests=requests, size=len(requests), max_tokens=max_input_tokens),
        max_input_tokens=max_input_tokens,
        max_prefill_tokens=max_prefill_tokens,
        max_total_tokens=max_total_tokens,
    )
    outcome = shard.call("Warmup", message)
    if not outcome.ok:
        raise RuntimeError(f"Warmup failed: {outcome.code} {outcome.details}")
    return outcome.response


# ---------------------------------------------------------------------------------------------- router


class VirtualBlocks:
    """The router's ``SimpleAllocator`` over the advertised virtual blocks (LIFO free list, block 0 kept)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = list(range(1, num_blocks))

    def allocate(self, num_tokens: int) -> tuple[list[int], list[int]] | None:
        need = max(1, -(-num_tokens // self.block_size))
        if need > len(self.free):
            return None
        blocks = self.free[len(self.free) - need :]
        del self.free[len(self.free) - need :]
        slots = [b * self.block_size + o for b in blocks for o in range(self.block_size)][:num_tokens]
        return blocks, slots

    def release(self, blocks: Iterable[int]) -> None:
        self.free.extend(blocks)


@dataclass
class Sent:
    """One request as the router sent it."""

    request: pb.Request
    owned_blocks: list[int] = field(default_factory=list)
    """Virtual blocks taken from the router's allocator for it (released when it leaves)."""
    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    final: Any = None
    """Its ``GeneratedText`` once finished."""


@dataclass
class CallStats:
    calls: int = 0
    by_code: dict[str, int] = field(default_factory=dict)
    generations: int = 0
    finished: int = 0
    failed_requests: int = 0
    cancelled_requests: int = 0

    def count(self, rpc: str, outcome: Outcome) -> None:
        self.calls += 1
        key = f"{rpc}:{'OK' if outcome.ok else outcome.code.name}"
        self.by_code[key] = self.by_code.get(key, 0) + 1


class RouterBooks:
    """The router's view of one shard, checked against the shard after every RPC."""

    def __init__(
        self,
        shard: LiveShard,
        *,
        check_books: bool = True,
        keep_done: bool = True,
        on_finish: Callable[[int, Sent], None] | None = None,
    ) -> None:
        """``keep_done``: keep finished requests in :attr:`done` (a long run passes ``False`` and reads them in
        ``on_finish(request_id, sent)`` instead, so the books do not grow)."""
        self.shard = shard
        self.engine = shard.engine
        self.check_books = check_books
        self.keep_done = keep_done
        self.on_finish = on_finish
        self.speculate = shard.config.model.num_speculative_tokens
        self.blocks = VirtualBlocks(self.engine.num_virtual_blocks, self.engine.block_size)
        self.batches: dict[int, list[int]] = {}
        self.live: dict[int, Sent] = {}
        self.done: dict[int, Sent] = {}
        self.stats = CallStats()

    # -- requests -------------------------------------------------------------------------------

    def prompt_len(self, text: str, truncate: int, add_special_tokens: bool = True) -> int:
        return len(self.engine.prompt_tokenizer.encode(text, truncate, add_special_tokens))

    def reserve(self, text: str, max_new_tokens: int, truncate: int = 10_000, add_special_tokens: bool = True):
        """Router blocks and slots for ``prompt + max_new_tokens - 1`` positions, or ``None`` when full."""
        return self.blocks.allocate(self.prompt_len(text, truncate, add_special_tokens) + max_new_tokens - 1)

    # -- calls ----------------------------------------------------------------------------------

    def prefill(self, message: pb.PrefillRequest, owned_blocks: Sequence[Sequence[int]] = ()) -> Outcome:
        """``owned_blocks[i]``: the virtual blocks ``message.batch.requests[i]`` took from :attr:`blocks`
        (given back when it leaves; missing: none)."""
        owned = list(owned_blocks) + [()] * (len(message.batch.requests) - len(owned_blocks))
        sent = [Sent(request=r, owned_blocks=list(b)) for r, b in zip(message.batch.requests, owned)]
        new_ids = [r.id for r in message.batch.requests]
        liveness = message.batch.id == U64_MAX
        cached = message.cached_batch.id if message.HasField("cached_batch") else None
        known_cached = cached if cached in self.batches and not liveness else None
        handed = list(self.batches.get(known_cached, [])) + new_ids if known_cached is not None else list(new_ids)
        # Requests the router would be tracking now (a duplicate or already-live id is sent anyway: the
        # shard must refuse it, and the live one keeps its entry).
        mine = {}
        for r, s in zip(message.batch.requests, sent):
            if r.id not in self.live and r.id not in mine:
                mine[r.id] = s
            else:
                self._release(s)
        outcome = self.shard.call("Prefill", message)
        self.stats.count("Prefill", outcome)
        self._check_status(outcome, "Prefill")
        if not outcome.ok:
            for s in mine.values():
                self._release(s)
            # A failed call frees the cached batch it was handed. The probe id is the exception: the engine
            # ignores a cached batch beside it (no router sends one) and keeps it when the probe's requests
            # are refused, while the servicer releases it when the probe's batch cannot even be converted.
            # Either is accepted here (the books checks still see any leak).
            if cached is not None and (not liveness or cached not in self.engine.batches):
                self._fail_batch(cached)
            self._check_shard("Prefill")
            return outcome
        for rid, s in mine.items():
            self.live[rid] = s
        batch_id = known_cached if known_cached is not None else message.batch.id
        if known_cached is not None:
            del self.batches[known_cached]
        self._absorb(outcome.response, handed, batch_id, "Prefill", liveness=liveness)
        if liveness:  # the probe keeps nothing, finished or not
            for rid in new_ids:
                if rid in mine and rid in self.live:
                    self._leave(rid)
        return outcome

    def decode(self, batch_ids: Sequence[int]) -> Outcome:
        known = [b for b in dict.fromkeys(batch_ids) if b in self.batches]
        handed = [rid for b in known for rid in self.batches[b]]
        outcome = self.shard.call("Decode", decode_message(batch_ids))
        self.stats.count("Decode", outcome)
        self._check_status(outcome, "Decode")
        if not outcome.ok:
            for b in known:
                self._fail_batch(b)
            self._check_shard("Decode")
            return outcome
        for b in known:
            del self.batches[b]
        self._absorb(outcome.response, handed, batch_ids[0], "Decode")
        return outcome

    def filter_batch(self, batch_id: int, request_ids: Sequence[int]) -> Outcome:
        outcome = self.shard.call("FilterBatch", pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids))
        self.stats.count("FilterBatch", outcome)
        self._check_status(outcome, "FilterBatch")
        if outcome.ok:
            if batch_id not in self.batches:
                raise ContractError(f"FilterBatch of unknown batch {batch_id} succeeded")
            keep = set(request_ids)
            current = self.batches[batch_id]
            for rid in current:
                if rid not in keep:
                    self.stats.cancelled_requests += 1
                    self._leave(rid)
            self.batches[batch_id] = [rid for rid in current if rid in keep]
            got = list(outcome.response.batch.request_ids)
            if got != self.batches[batch_id] or outcome.response.batch.id != batch_id:
                raise ContractError(f"FilterBatch({batch_id}) kept {got}, expected {self.batches[batch_id]}")
        elif batch_id in self.batches:
            raise ContractError(f"FilterBatch of cached batch {batch_id} failed: {outcome.code} {outcome.details}")
        self._check_shard("FilterBatch")
        return outcome

    def clear_cache(self, batch_id: int | None) -> Outcome:
        message = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        outcome = self.shard.call("ClearCache", message)
        self.stats.count("ClearCache", outcome)
        if not outcome.ok:
            raise ContractError(f"ClearCache({batch_id}) failed: {outcome.code} {outcome.details}")
        for b in list(self.batches) if batch_id is None else [batch_id]:
            if b in self.batches:
                for rid in self.batches.pop(b):
                    self.stats.cancelled_requests += 1
                    self._leave(rid)
        self._check_shard("ClearCache")
        return outcome

    def health(self) -> Outcome:
        outcome = self.shard.call("Health", pb.HealthRequest())
        self.stats.count("Health", outcome)
        if not outcome.ok:
            raise ContractError(f"Health failed: {outcome.code} {outcome.details}")
        return outcome

    # -- bookkeeping ----------------------------------------------------------------------------

    def _check_status(self, outcome: Outcome, rpc: str) -> None:
        if outcome.ok:
            return
        if not outcome.details.strip():
            raise ContractError(f"{rpc} ended in {outcome.code} without a message")
        if outcome.code not in EXPECTED_ERRORS:
            raise ContractError(f"{rpc} ended in {outcome.code.name}: {outcome.details}")

    def _release(self, sent: Sent) -> None:
        if sent.owned_blocks:
            self.blocks.release(sent.owned_blocks)
            sent.owned_blocks = []

    def _leave(self, rid: int) -> None:
        sent = self.live.pop(rid, None)
        if sent is not None:
            self._release(sent)

    def _fail_batch(self, batch_id: int) -> None:
        for rid in self.batches.pop(batch_id, []):
            self.stats.failed_requests += 1
            self._leave(rid)

    def _absorb(self, response: Any, handed: list[int], batch_id: int, rpc: str, *, liveness: bool = False) -> None:
        seen: set[int] = set()
        finished: set[int] = set()
        for g in response.generations:
            rid = g.request_id
            if rid not in handed:
                raise ContractError(f"{rpc}: Generation for request {rid}, which was not in the call")
            if rid in seen:
                raise ContractError(f"{rpc}: two Generations for request {rid}")
            seen.add(rid)
            t = g.tokens
            if not 1 <= len(t.ids) <= 1 + self.speculate:
                raise ContractError(f"{rpc}: request {rid} got {len(t.ids)} tokens in one Generation")
            if not len(t.ids) == len(t.logprobs) == len(t.texts) == len(t.is_special):
                raise ContractError(f"{rpc}: request {rid}: Tokens lists of different lengths")
            if not all(math.isfinite(x) for x in t.logprobs):
                raise ContractError(f"{rpc}: request {rid}: non-finite log-probability {list(t.logprobs)}")
            sent = self.live.get(rid)
            if sent is None:
                raise ContractError(f"{rpc}: Generation for request {rid}, which the router does not track")
            sent.tokens.extend(t.ids)
            sent.texts.extend(t.texts)
            self.stats.generations += 1
            max_new = sent.request.stopping_parameters.max_new_tokens
            if len(sent.tokens) > max_new:
                raise ContractError(f"{rpc}: request {rid} has {len(sent.tokens)} tokens > max_new_tokens {max_new}")
            if g.HasField("generated_text"):
                gt = g.generated_text
                if gt.generated_tokens != len(sent.tokens):
                    raise ContractError(f"{rpc}: request {rid} final says {gt.generated_tokens} tokens")
                sent.final = gt
                finished.add(rid)
        listed = list(response.batch.request_ids) if response.HasField("batch") else []
        if response.HasField("batch"):
            if liveness:
                raise ContractError("the liveness probe's response carries a batch")
            if response.batch.id != batch_id:
                raise ContractError(f"{rpc}: batch id {response.batch.id}, expected {batch_id}")
            if len(set(listed)) != len(listed) or response.batch.size != len(listed):
                raise ContractError(f"{rpc}: CachedBatch ids {listed} size {response.batch.size}")
            if not listed:
                raise ContractError(f"{rpc}: an empty CachedBatch")
        lost = set(handed) - finished - set(listed)
        if lost and not liveness:
            raise ContractError(f"{rpc}: requests {sorted(lost)} neither finished nor listed (lost)")
        if finished & set(listed):
            raise ContractError(f"{rpc}: finished requests {sorted(finished & set(listed))} still listed")
        if set(listed) - set(handed):
            raise ContractError(f"{rpc}: CachedBatch lists requests {sorted(set(listed) - set(handed))} not handed")
        for rid in finished:
            self.stats.finished += 1
            sent = self.live[rid]
            if self.keep_done:
                self.done[rid] = sent
            self._leave(rid)
            if self.on_finish is not None:
                self.on_finish(rid, sent)
        if listed:
            self.batches[batch_id] = listed
        self._check_shard(rpc)

    def _check_shard(self, rpc: str) -> None:
        """The shard's batches are the router's, it holds no request outside them, its books balance."""
        if not self.shard.alive:
            raise ContractError(f"after {rpc}: the shard's server thread is gone ({self.shard.error!r})")
        if not self.check_books:
            return
        engine = self.engine
        shard_batches = {b: list(ids) for b, ids in engine.batches.items()}
        if shard_batches != self.batches:
            raise ContractError(f"after {rpc}: shard batches {shard_batches} != router batches {self.batches}")
        owned = {rid for ids in engine.batches.values() for rid in ids}
        if set(engine.requests) != owned:
            orphans = sorted(set(engine.requests) - owned)
            raise ContractError(f"after {rpc}: requests {orphans} live in the shard but no batch owns them")
        engine.kv.check_invariants()

    def assert_empty(self) -> None:
        """Nothing cached anywhere: no request, no used or swapped block."""
        engine = self.engine
        stats = engine.kv.stats()
        if self.batches or engine.batches or engine.requests:
            raise ContractError(f"not empty: router {self.batches}, shard {engine.batches}, {list(engine.requests)}")
        if engine.kv.num_used_blocks or engine.kv.num_swapped_blocks:
            raise ContractError(f"leaked blocks: {stats}")
        engine.kv.check_invariants()
