"""The stock router's request queue and ``next_batch``, replayed.

Strict FIFO with head-of-line blocking: entries are popped from the front and the first one that
does not fit stops the scan (it goes back to the front). Request ids and batch ids each count up
from 0 for the router's lifetime (a request id is consumed even if the entry is later dropped).

Budgets (``next_batch(min_size, max_size, prefill_token_budget, token_budget)``):

* ``None`` at once if either budget is 0, the queue is empty, fewer than ``min_size`` entries wait,
  or ``max_size == 0``;
* the prefill budget is rounded **up** to a multiple of ``block_size``;
* paged mode: each entry asks the allocator for ``input_length + max_new_tokens + speculate - 1``
  slots (prompt ids passed for prefix matching unless it wants prefill logprobs); allocation failure
  stops the scan; a full prefix hit is shaved by one token; if the remaining prompt does not fit the
  prefill budget the entry is either cut to ``chunk_len`` and becomes the last request (chunking) or
  pushed back; ``token_budget`` is not consulted beyond the ``== 0`` exit;
* padded mode (``requires_padding``): ``(n + 1) * max_input_length`` prefill tokens plus the sum of
  ``max_new_tokens`` plus ``speculate`` must fit; the rejected entry's numbers stay in the sums;
* a batch smaller than ``min_size`` is pushed back whole (its allocations are dropped, in reverse).

``Batch.max_tokens`` is ``prefill_tokens + decode_tokens`` (paged: prompt tokens to compute of the
non-chunked entries only), ``Batch.max_blocks`` the largest allocation seen (pushed-back included).
"""

from __future__ import annotations

import time
from collections import deque

from tgi_paged_backend.server.pb import generate_pb2 as pb

from .allocator import Allocator, BlockAllocation, ceil_div, make_allocator
from .datatypes import Entry, ValidRequest

U32 = 0xFFFFFFFF


def input_chunks(request: ValidRequest) -> list[pb.InputChunk]:
    """The request's chunks in order (images as ``Image{data, mimetype}``), or its text as one chunk."""
    if not request.chunks:
        return [pb.InputChunk(text=request.inputs)]
    return [
        pb.InputChunk(text=c) if isinstance(c, str) else pb.InputChunk(image=pb.Image(data=c.data, mimetype=c.mimetype))
        for c in request.chunks
    ]


def request_to_pb(
    request_id: int, request: ValidRequest, allocation: BlockAllocation | None, chunk_len: int | None
) -> pb.Request:
    """The ``Request`` message the stock queue builds (full untruncated text, twice)."""
    grammar_type = pb.GRAMMAR_TYPE_REGEX if request.grammar is not None else pb.GRAMMAR_TYPE_NONE
    message = pb.Request(
        id=request_id,
        inputs=request.inputs,
        input_chunks=pb.Input(chunks=input_chunks(request)),
        truncate=request.truncate,
        add_special_tokens=request.add_special_tokens,
        parameters=pb.NextTokenChooserParameters(
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            typical_p=request.typical_p,
            do_sample=request.do_sample,
            seed=request.seed,
            repetition_penalty=request.repetition_penalty,
            frequency_penalty=request.frequency_penalty,
            watermark=request.watermark,
            grammar=request.grammar or "",
            grammar_type=grammar_type,
        ),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=request.max_new_tokens,
            stop_sequences=request.stop_sequences,
            ignore_eos_token=request.ignore_eos_token,
        ),
        prefill_logprobs=request.decoder_input_details,
        top_n_tokens=request.top_n_tokens,
        blocks=allocation.blocks if allocation is not None else [],
        slots=allocation.slots if allocation is not None else [],
        cache_len=allocation.prefix_len if allocation is not None else 0,
    )
    if request.adapter_id is not None:
        message.adapter_id = request.adapter_id
    if chunk_len is not None:
        message.chunk_len = chunk_len
    return message


class Queue:
    def __init__(
        self,
        *,
        requires_padding: bool,
        block_size: int,
        prefix_caching: bool,
        window_size: int | None,
        speculate: int,
        max_batch_total_tokens: int,
        support_chunking: bool,
    ) -> None:
        self.block_size = block_size
        self.speculate = speculate
        self.support_chunking = support_chunking
        self.allocator: Allocator | None = (
            None
            if requires_padding
            else make_allocator(max_batch_total_tokens, block_size, prefix_caching, window_size)
        )
        self.entries: deque[tuple[int, Entry]] = deque()
        self.next_id = 0
        self.next_batch_id = 0
        self.dropped = 0
        """Entries dropped at pop because their client had gone (``tgi_request_failure{err=dropped}``)."""
        self.stop_reason: str | None = None
        """Why the last :meth:`next_batch` left entries in the queue (not part of the stock router; for
        benchmarks): ``kv`` (the token budget is spent -- the shard's reported ``max_tokens`` fills the
        KV budget -- or the block allocator refused the head), ``prefill`` (the prefill token budget),
        ``size`` (``min_size``/``max_size``), or ``None`` (nothing left behind)."""

    def __len__(self) -> int:
        return len(self.entries)

    def append(self, entry: Entry) -> int:
        request_id = self.next_id
        self.entries.append((request_id, entry))
        self.next_id += 1
        return request_id

    def next_batch(
        self, min_size: int | None, max_size: int | None, prefill_token_budget: int, token_budget: int
    ) -> tuple[dict[int, Entry], pb.Batch] | None:
        self.stop_reason = None
        if not self.entries:
            return None
        if token_budget == 0:
            self.stop_reason = "kv"
            return None
        if prefill_token_budget == 0:
            self.stop_reason = "prefill"
            return None
        if (min_size is not None and len(self.entries) < min_size) or (max_size is not None and max_size == 0):
            self.stop_reason = "size"
            return None

        budget = ceil_div(prefill_token_budget, self.block_size) * self.block_size
        picked: list[tuple[int, Entry, BlockAllocation | None, int | None]] = []
        max_input_length = prefill_tokens = decode_tokens = max_blocks = 0

        while self.entries:
            request_id, entry = self.entries.popleft()
            if entry.channel.closed:
                self.dropped += 1
                entry.drop()
                continue
            request = entry.request
            allocation: BlockAllocation | None = None
            if self.allocator is None:
                max_input_length = max(max_input_length, request.input_length)
                prefill_tokens = (len(picked) + 1) * max_input_length
                decode_tokens += request.max_new_tokens
                total_tokens = prefill_tokens + decode_tokens + self.speculate
                if prefill_tokens > budget or total_tokens > token_budget:
                    self.entries.appendleft((request_id, entry))
                    self.stop_reason = "prefill" if prefill_tokens > budget else "kv"
                    break
            else:
                prompt_ids = None if request.decoder_input_details else request.input_ids
                tokens = request.input_length + request.max_new_tokens + self.speculate - 1
                allocation = self.allocator.allocate(tokens, prompt_ids)
                if allocation is None:
                    self.entries.appendleft((request_id, entry))
                    self.stop_reason = "kv"
                    break
                max_blocks = max(max_blocks, len(allocation.blocks))
                if allocation.prefix_len == request.input_length:
                    # At least one prompt token must be computed.
                    allocation.prefix_len -= 1
                postfix_len = request.input_length - allocation.prefix_len
                if prefill_tokens + postfix_len > budget:
                    chunk_len = max(0, budget - prefill_tokens)
                    if self.support_chunking and chunk_len > 0:
                        picked.append((request_id, entry, allocation, chunk_len))
                    else:
                        self.entries.appendleft((request_id, entry))
                        allocation.free()
                    self.stop_reason = "prefill" if self.entries else None
                    break
                prefill_tokens += postfix_len
            picked.append((request_id, entry, allocation, None))
            if max_size is not None and len(picked) == max_size:
                self.stop_reason = "size" if self.entries else None
                break

        if not picked:
            return None
        if min_size is not None and len(picked) < min_size:
            self.stop_reason = self.stop_reason or "size"
            for request_id, entry, allocation, _ in reversed(picked):
                self.entries.appendleft((request_id, entry))
                if allocation is not None:
                    allocation.free()
            return None

        now = time.monotonic()
        entries: dict[int, Entry] = {}
        requests = []
        for request_id, entry, allocation, chunk_len in picked:
            entry.block_allocation = allocation
            entry.batch_time = now
            requests.append(request_to_pb(request_id, entry.request, allocation, chunk_len))
            entries[request_id] = entry
        batch = pb.Batch(
            id=self.next_batch_id,
            requests=requests,
            size=len(requests),
            max_tokens=(prefill_tokens + decode_tokens) & U32,
            max_blocks=max_blocks,
        )
        self.next_batch_id += 1
        return entries, batch
