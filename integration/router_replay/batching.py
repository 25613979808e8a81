"""The stock router's batching task, replayed: the only issuer of Prefill/Decode/FilterBatch/ClearCache.

Loop (one RPC at a time)::

    wait for a queue append (a stored wake-up counts)
    while next_batch(None, max_batch_size, max_batch_prefill_tokens, max_batch_total_tokens):
        cached = prefill(batch); waiting_tokens = 1
        while cached:
            token budget = max_batch_total_tokens - cached.max_tokens
            chunking:  prefill budget = max_batch_prefill_tokens - cached.current_tokens, no size limits
            otherwise: min_size = None after max_waiting_tokens steps, else floor(size * ratio);
                       max_size = max_batch_size - size
            if next_batch(...):
                chunking:  Prefill(new, cached_batch=cached) over all entries (None -> leave the loop)
                otherwise: Prefill(new) alone, then both batches go into the next Decode
                waiting_tokens = 1
            cached = Decode(batches); waiting_tokens += 1
        entries still alive here are dropped (their clients see an incomplete generation)

After every step: generations are delivered in response order (a final one frees the request's
blocks at once), then the returned batch is filtered: nothing if ``size == live entries``,
``ClearCache(id)`` if none survive, else ``FilterBatch(id, kept)``. A step that fails calls
``ClearCache`` for the batch ids it sent (result ignored) and fails the entries it covered.

Every condition that panics the stock batching task raises ``RouterFatalError``; with ``strict``
(the default) so do the contract violations the stock router lets through (see ``_check``).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from dataclasses import dataclass

from tgi_paged_backend.server.pb import generate_pb2 as pb

from .client import ClientError, ShardedClient
from .datatypes import (
    FINISH_REASONS,
    End,
    Entry,
    Failure,
    GeneratedText,
    Intermediate,
    PrefillEvent,
    PrefillToken,
    Token,
)
from .errors import GenerationError, RouterFatalError
from .info import RouterStats
from .queue import Queue


def _f32(x: float) -> float:
    """Round to IEEE single precision (the stock ``min_size`` is computed in ``f32``)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class BatchingConfig:
    waiting_served_ratio: float
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_waiting_tokens: int
    max_batch_size: int | None
    support_chunking: bool
    strict: bool = True


def _token_lists(tokens: pb.Tokens, with_special: bool = True) -> list[tuple]:
    lists = [tokens.ids, tokens.logprobs, tokens.texts] + ([tokens.is_special] if with_special else [])
    return list(zip(*lists))


def _equal_lengths(tokens: pb.Tokens, with_special: bool = True) -> bool:
    lengths = {len(tokens.ids), len(tokens.logprobs), len(tokens.texts)}
    if with_special:
        lengths.add(len(tokens.is_special))
    return len(lengths) == 1


class Batcher:
    def __init__(self, client: ShardedClient, queue: Queue, config: BatchingConfig, stats: RouterStats) -> None:
        self.client = client
        self.queue = queue
        self.config = config
        self.stats = stats
        self.wakeup = asyncio.Event()
        self.on_fatal: Callable[[RouterFatalError], None] = lambda err: None

    def notify(self) -> None:
        self.wakeup.set()

    async def run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except RouterFatalError as err:
            self.on_fatal(err)
        except Exception as err:  # a bug in the replay must not hang the callers either
            self.on_fatal(RouterFatalError("replay_internal_error", repr(err)))

    async def _loop(self) -> None:
        cfg = self.config
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while True:
                picked = self.queue.next_batch(
                    None, cfg.max_batch_size, cfg.max_batch_prefill_tokens, cfg.max_batch_total_tokens
                )
                if picked is None:
                    break
                entries, batch = picked
                self._track(entries)
                cached = await self._prefill(batch, None, entries)
                waiting_tokens = 1
                while cached is not None:
                    batches = [cached]
                    token_budget = max(0, cfg.max_batch_total_tokens - cached.max_tokens)
                    if cfg.support_chunking:
                        min_size = max_size = None
                        prefill_budget = max(0, cfg.max_batch_prefill_tokens - cached.current_tokens)
                    else:
                        min_size = (
                            None
                            if waiting_tokens >= cfg.max_waiting_tokens
                            else int(_f32(_f32(cached.size) * _f32(cfg.waiting_served_ratio)) // 1)
                        )
                        max_size = max(0, cfg.max_batch_size - cached.size) if cfg.max_batch_size is not None else None
                        prefill_budget = cfg.max_batch_prefill_tokens
                    picked = self.queue.next_batch(min_size, max_size, prefill_budget, token_budget)
                    if picked is not None:
                        new_entries, new_batch = picked
                        reason = "chunking" if cfg.support_chunking else "wait_exceeded"
                        reason = "backpressure" if min_size is not None else reason
                        self.stats.batch_concat[reason] = self.stats.batch_concat.get(reason, 0) + 1
                        if cfg.support_chunking:
                            entries.update(new_entries)
                            self._track(entries)
                            new_cached = await self._prefill(new_batch, batches.pop(), entries)
                            if new_cached is None:
                                break
                        else:
                            new_cached = await self._prefill(new_batch, None, new_entries)
                            if new_cached is not None:
                                entries.update(new_entries)
                                self._track(entries)
                            else:
                                self._drop_all(new_entries)
                        waiting_tokens = 1
                        if new_cached is not None:
                            batches.append(new_cached)
                    cached = await self._decode(batches, entries)
                    waiting_tokens += 1
                self._drop_all(entries)

    def _track(self, entries: dict[int, Entry]) -> None:
        self.stats.concurrency_peak = max(self.stats.concurrency_peak, len(entries))

    def _drop_all(self, entries: dict[int, Entry]) -> None:
        """Entries the loop lets go without a final generation: their clients see an incomplete one."""
        for request_id in sorted(entries):
            self.stats.requests_incomplete += 1
            entries[request_id].drop()
        entries.clear()

    def _fatal(self, condition: str, message: str) -> None:
        raise RouterFatalError(condition, message)

    # -- steps -------------------------------------------------------------------------------

    async def _prefill(
        self, batch: pb.Batch, cached_batch: pb.CachedBatch | None, entries: dict[int, Entry]
    ) -> pb.CachedBatch | None:
        self.stats.prefill_calls += 1
        try:
            generations, next_batch = await self.client.prefill(batch, cached_batch)
        except ClientError as err:
            self._on_step_error("Prefill", err, [batch.id], entries)
            await self._clear_cache_ignoring([batch.id])
            self._send_errors(err, entries)
            return None
        removed = self._filter_send_generations(generations, entries)
        return await self._filter_batch(next_batch, entries, removed, "Prefill")

    async def _decode(self, batches: list[pb.CachedBatch], entries: dict[int, Entry]) -> pb.CachedBatch | None:
        self.stats.decode_calls += 1
        try:
            generations, next_batch = await self.client.decode(batches)
        except ClientError as err:
            ids = [b.id for b in batches]
            self._on_step_error("Decode", err, ids, entries)
            await self._clear_cache_ignoring(ids)
            self._send_errors(err, entries)
            return None
        removed = self._filter_send_generations(generations, entries)
        return await self._filter_batch(next_batch, entries, removed, "Decode")

    def _on_step_error(self, method: str, err: ClientError, ids: list[int], entries: dict[int, Entry]) -> None:
        if method == "Prefill":
            self.stats.prefill_failures += 1
        else:
            self.stats.decode_failures += 1
        if err.too_large and self.config.strict:
            self._fatal("response_too_large", f"{method} response over 4 MiB for batches {ids}: {err}")

    async def _clear_cache_ignoring(self, batch_ids: list[int]) -> None:
        for batch_id in batch_ids:
            self.stats.clear_cache_calls += 1
            try:
                await self.client.clear_cache(batch_id)
            except ClientError:
                pass

    def _send_errors(self, err: ClientError, entries: dict[int, Entry]) -> None:
        for request_id in sorted(entries):
            entry = entries[request_id]
            self.stats.requests_failed += 1
            entry.channel.send(Failure(GenerationError(err.message)))
            entry.drop()
        entries.clear()

    async def _filter_batch(
        self, next_batch: pb.CachedBatch | None, entries: dict[int, Entry], removed: set[int], method: str
    ) -> pb.CachedBatch | None:
        strict = self.config.strict
        if next_batch is None:
            if strict and entries:
                self._fatal(
                    "request_vanished",
                    f"{method} returned no batch while requests {sorted(entries)} had no final generation",
                )
            return None
        batch_ids = list(next_batch.request_ids)
        if strict:
            self._check_cached_batch(next_batch, method)
            present = set(batch_ids)
            vanished = [rid for rid in entries if rid not in present]
            if vanished:
                self._fatal(
                    "request_vanished",
                    f"{method} returned CachedBatch {next_batch.id} without requests {vanished}, "
                    "which had no final generation",
                )
            foreign = [rid for rid in batch_ids if rid not in entries and rid not in removed]
            if foreign:
                self._fatal(
                    "foreign_request_id",
                    f"{method} returned CachedBatch {next_batch.id} with requests {foreign} "
                    "that are not live in this step",
                )
        if next_batch.size == len(entries):
            return next_batch
        kept = [rid for rid in batch_ids if rid in entries]
        if not kept:
            self.stats.clear_cache_calls += 1
            try:
                await self.client.clear_cache(next_batch.id)
            except ClientError as err:
                self._fatal("clear_cache_failed", f"ClearCache({next_batch.id}) failed: {err}")
            return None
        self.stats.filter_batch_calls += 1
        try:
            filtered = await self.client.filter_batch(next_batch.id, kept)
        except ClientError as err:
            self._fatal("filter_batch_failed", f"FilterBatch({next_batch.id}, {kept}) failed: {err}")
        if strict:
            if filtered is None:
                self._fatal("filter_batch_empty", f"FilterBatch({next_batch.id}, {kept}) returned no batch")
            self._check_cached_batch(filtered, "FilterBatch")
            if sorted(filtered.request_ids) != sorted(kept):
                self._fatal(
                    "filter_batch_mismatch",
                    f"FilterBatch({next_batch.id}, {kept}) returned requests {list(filtered.request_ids)}",
                )
        return filtered

    def _check_cached_batch(self, batch: pb.CachedBatch, method: str) -> None:
        if batch.size != len(batch.request_ids):
            self._fatal(
                "cached_batch_size",
                f"{method} returned CachedBatch {batch.id} with size {batch.size} "
                f"but {len(batch.request_ids)} request ids",
            )

    # -- generations -------------------------------------------------------------------------

    def _filter_send_generations(self, generations: list[pb.Generation], entries: dict[int, Entry]) -> set[int]:
        removed: set[int] = set()
        for generation in generations:
            request_id = generation.request_id
            entry = entries.get(request_id)
            if entry is None:
                self._fatal(
                    "unknown_request_id",
                    f"Generation for request {request_id}, which is unknown or already finished "
                    "(stock: 'ID not found in entries. This is a bug.')",
                )
            if self.config.strict:
                self._check(generation, entry)
            if self._send_responses(generation, entry):
                del entries[request_id]
                entry.drop()
                removed.add(request_id)
        return removed

    def _check(self, generation: pb.Generation, entry: Entry) -> None:
        """Contract checks beyond the stock panics (strict mode)."""
        rid = generation.request_id
        request = entry.request
        if not generation.HasField("tokens") or not generation.tokens.ids:
            self._fatal("generation_without_tokens", f"Generation for request {rid} has no (or empty) tokens")
        tokens = generation.tokens
        if not _equal_lengths(tokens) or not all(_equal_lengths(t) for t in generation.top_tokens):
            self._fatal(
                "unequal_token_lists",
                f"Generation for request {rid}: ids/logprobs/texts/is_special lengths "
                f"{len(tokens.ids)}/{len(tokens.logprobs)}/{len(tokens.texts)}/{len(tokens.is_special)} "
                "(or a top_tokens entry) differ",
            )
        if generation.HasField("prefill_tokens"):
            if not request.decoder_input_details or entry.prefill_received:
                self._fatal(
                    "unsolicited_prefill_tokens",
                    f"Generation for request {rid} carries prefill_tokens that were not requested "
                    "(or were already sent)",
                )
            if not _equal_lengths(generation.prefill_tokens, with_special=False):
                self._fatal("unequal_token_lists", f"prefill_tokens of request {rid} have unequal lists")
        produced = entry.tokens_received + len(tokens.ids)
        if produced > request.max_new_tokens:
            self._fatal(
                "too_many_tokens",
                f"request {rid} received {produced} tokens but max_new_tokens is {request.max_new_tokens}",
            )
        if generation.HasField("generated_text"):
            final = generation.generated_text
            if final.finish_reason not in FINISH_REASONS:
                self._fatal("invalid_finish_reason", f"request {rid}: finish_reason {final.finish_reason}")
            if final.generated_tokens == 0:
                self._fatal("zero_generated_tokens", f"request {rid}: generated_tokens == 0")
            if final.generated_tokens != produced:
                self._fatal(
                    "generated_tokens_mismatch",
                    f"request {rid}: generated_tokens {final.generated_tokens} but {produced} tokens were sent",
                )

    def _send_responses(self, generation: pb.Generation, entry: Entry) -> bool:
        """Deliver one generation; True when the entry is finished (final token, or client gone)."""
        channel = entry.channel
        if channel.closed:
            self.stats.requests_dropped += 1
            return True
        if generation.HasField("prefill_tokens"):
            entry.prefill_received = True
            prefill = tuple(PrefillToken(i, t, lp) for i, lp, t in _token_lists(generation.prefill_tokens, False))
            if not channel.send(PrefillEvent(prefill)):
                return True
        if not generation.HasField("tokens"):
            self._fatal("generation_without_tokens", f"Generation for request {generation.request_id} has no tokens")
        entry.tokens_received += len(generation.tokens.ids)
        rows = _token_lists(generation.tokens)
        final = generation.generated_text if generation.HasField("generated_text") else None
        stopped = False
        for i, (token_id, logprob, text, special) in enumerate(rows):
            token = Token(token_id, text, logprob, special)
            top = ()
            if i < len(generation.top_tokens):
                top = tuple(Token(a, c, b, d) for a, b, c, d in _token_lists(generation.top_tokens[i]))
            if final is not None and i == len(rows) - 1:
                if final.finish_reason not in FINISH_REASONS:
                    self._fatal(
                        "invalid_finish_reason",
                        f"request {generation.request_id}: finish_reason {final.finish_reason}",
                    )
                generated = GeneratedText(
                    text=final.text,
                    generated_tokens=final.generated_tokens,
                    finish_reason=FINISH_REASONS[final.finish_reason],
                    seed=final.seed if final.HasField("seed") else None,
                )
                assert entry.batch_time is not None
                sent = channel.send(End(token, top, generated, entry.queue_time, entry.batch_time))
                stopped = True
            else:
                sent = channel.send(Intermediate(token, top))
            if not sent:
                return True
        if stopped:
            self.stats.requests_finished += 1
        return stopped
