"""Router replay, pure parts: block allocators, queue budgets, warmup batch, startup limit derivation."""

from __future__ import annotations

import pytest

from integration.router_replay.allocator import SimpleAllocator
from integration.router_replay.client import build_liveness_batch, build_warmup_request
from integration.router_replay.datatypes import Entry, ResponseChannel, ValidRequest
from integration.router_replay.errors import RouterStartupError
from integration.router_replay.queue import Queue
from integration.router_replay.radix import RadixAllocator
from integration.router_replay.router import check_startup_args, derive_limits
from tgi_paged_backend.server.pb import generate_pb2 as pb


def test_simple_allocator_tail_blocks_slots_and_lifo_reuse():
    alloc = SimpleAllocator(num_blocks=100, block_size=16)
    a = alloc.allocate(12, None)  # 10 prompt + 3 new - 1 (contract §2.10 trace)
    b = alloc.allocate(20, None)
    assert a.blocks == [99] and a.slots == list(range(1584, 1596))
    assert b.blocks == [97, 98] and b.slots == list(range(1552, 1572))
    assert a.prefix_len == 0 and b.prefix_len == 0
    b.free()
    b.free()  # idempotent, like a Drop
    c = alloc.allocate(32, None)
    assert c.blocks == [97, 98]  # LIFO: the blocks just freed come back first
    assert len(c.slots) == 32


def test_simple_allocator_never_hands_out_block_zero():
    alloc = SimpleAllocator(num_blocks=8, block_size=4)
    got = [alloc.allocate(4, None) for _ in range(7)]
    assert sorted(b for a in got for b in a.blocks) == list(range(1, 8))
    assert alloc.allocate(1, None) is None
    assert alloc.free_block_count() == 0


def test_simple_allocator_window_cycles_blocks():
    alloc = SimpleAllocator(num_blocks=10, block_size=2, window_size=4)
    a = alloc.allocate(7, None)
    assert a.blocks == [8, 9]
    assert a.slots == [16, 17, 18, 19, 16, 17, 18]


def test_radix_prefix_hit_is_block_aligned_and_shared():
    alloc = RadixAllocator(block_size=4, num_blocks=32)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2
    a = alloc.allocate(10 + 5 - 1, prompt)
    assert a.prefix_len == 0 and len(a.blocks) == 4
    a.free()  # inserts the two full prompt blocks, frees the rest
    assert alloc.free_block_count() == 31 - 2
    b = alloc.allocate(10 + 5 - 1, prompt + [7])
    assert b.prefix_len == 8 and b.blocks[:2] == a.blocks[:2]
    assert b.slots[:8] == [s for blk in a.blocks[:2] for s in range(blk * 4, blk * 4 + 4)]
    # Prefill-logprob requests (no prompt ids) bypass the trie.
    c = alloc.allocate(14, None)
    assert c.prefix_len == 0 and not set(c.blocks) & set(a.blocks[:2])


def test_radix_lru_eviction_and_duplicate_insert():
    alloc = RadixAllocator(block_size=1, num_blocks=8)  # 7 usable blocks
    x = alloc.allocate(3, [1, 2, 3])
    y = alloc.allocate(3, [1, 2, 3])  # nothing inserted yet: no hit, fresh blocks
    assert y.prefix_len == 0
    x.free()
    y.free()  # duplicates of x's insertion go back to the free list
    assert alloc.free_block_count() == 7 - 3
    # Needing 6 blocks evicts the unreferenced cached prompt (LRU leaf), trimming only what's needed.
    z = alloc.allocate(6, [9, 9, 9, 9, 9, 9])
    assert z is not None and z.prefix_len == 0
    assert z.blocks == [1, 2, 3, 4, 6, 7]  # the cached 3-block leaf lost its last two blocks
    assert alloc.free_block_count() == 0 and alloc.trie.cached_blocks() == 1
    # What is left of the cached prompt still matches its first token.
    assert alloc.allocate(2, [1, 2]) is None  # no block left for the suffix; the prefix ref is undone
    z.free()  # its 6 prompt blocks become a cached leaf
    w = alloc.allocate(2, [1, 2])  # evicts one block from the end of the LRU leaf
    assert w.prefix_len == 1 and w.blocks == [5, 7]


def _valid(input_ids, max_new_tokens=4, details=False) -> ValidRequest:
    return ValidRequest(
        inputs="x" * len(input_ids), input_ids=list(input_ids), input_length=len(input_ids), truncate=100,
        add_special_tokens=True, decoder_input_details=details, temperature=1.0, top_k=0, top_p=1.0,
        typical_p=1.0, do_sample=False, seed=3, repetition_penalty=1.0, frequency_penalty=0.0,
        watermark=False, grammar=None, max_new_tokens=max_new_tokens, max_total_new_tokens=max_new_tokens,
        stop_sequences=[], ignore_eos_token=False, top_n_tokens=0, adapter_id=None,
    )  # fmt: skip


def _queue(**kw) -> Queue:
    args = dict(requires_padding=False, block_size=4, prefix_caching=False, window_size=None, speculate=0,
                max_batch_total_tokens=400, support_chunking=False)  # fmt: skip
    args.update(kw)
    return Queue(**args)


def _push(queue: Queue, n_tokens: int, **kw) -> Entry:
    entry = Entry(_valid(range(n_tokens), **kw), ResponseChannel(), 0.0)
    queue.append(entry)
    return entry


def test_queue_budget_rounds_up_and_blocks_head_of_line():
    q = _queue()
    _push(q, 6)
    _push(q, 6)
    _push(q, 1)
    # Budget 9 rounds up to 12 (block multiple): the first two (12 tokens) fit, the third waits.
    entries, batch = q.next_batch(None, None, 9, 400)
    assert list(entries) == [0, 1] and batch.size == 2 and batch.max_tokens == 12
    assert batch.max_blocks == 3  # ceil((6 + 4 - 1) / 4)
    assert batch.requests[0].slots and len(batch.requests[0].slots) == 9
    assert not batch.requests[0].HasField("chunk_len")
    # A 30-token request blocks the small one behind it (strict FIFO) without chunking.
    q2 = _queue()
    _push(q2, 30)
    _push(q2, 1)
    assert q2.next_batch(None, None, 16, 400) is None
    assert len(q2) == 2 and q2.allocator.free_block_count() == 99  # pushed-back allocation freed


def test_queue_chunking_sets_chunk_len_on_last_request():
    q = _queue(support_chunking=True)
    _push(q, 6)
    _push(q, 30)
    _push(q, 1)
    entries, batch = q.next_batch(None, None, 16, 400)
    assert list(entries) == [0, 1]
    assert not batch.requests[0].HasField("chunk_len")
    assert batch.requests[1].chunk_len == 10  # 16 - 6
    assert batch.max_tokens == 6  # the chunked entry is not counted
    assert len(q) == 1


def test_queue_early_exits_min_size_and_max_size():
    q = _queue()
    assert q.next_batch(None, None, 0, 10) is None and q.next_batch(None, None, 10, 0) is None
    _push(q, 4)
    _push(q, 4)
    assert q.next_batch(3, None, 100, 400) is None  # fewer queued than min_size
    assert q.next_batch(None, 0, 100, 400) is None
    before = q.allocator.free_block_count()
    entries, batch = q.next_batch(None, 1, 100, 400)
    assert list(entries) == [0] and batch.id == 0
    assert q.allocator.free_block_count() == before - 2
    entries, batch = q.next_batch(None, None, 100, 400)
    assert batch.id == 1 and list(entries) == [1]


def test_queue_min_size_pushback_restores_order_and_frees():
    q = _queue()
    _push(q, 4)
    _push(q, 30)  # does not fit budget 16 -> batch of 1 < min_size 2
    free = q.allocator.free_block_count()
    assert q.next_batch(2, None, 16, 400) is None
    assert [rid for rid, _ in q.entries] == [0, 1]
    assert q.allocator.free_block_count() == free


def test_queue_drops_entries_whose_client_left():
    q = _queue()
    gone = _push(q, 4)
    gone.channel.close()
    _push(q, 4)
    entries, _ = q.next_batch(None, None, 100, 400)
    assert list(entries) == [1] and q.dropped == 1
    assert gone.channel.sender_dropped


def test_queue_full_prefix_hit_keeps_one_token_to_compute():
    q = _queue(prefix_caching=True)
    first = _push(q, 8)
    entries, _ = q.next_batch(None, None, 100, 400)
    first.drop()  # finished: its 2 full prompt blocks enter the trie
    _push(q, 8)
    _, batch = q.next_batch(None, None, 100, 400)
    assert batch.requests[0].cache_len == 7
    assert batch.max_tokens == 1
    _push(q, 8, details=True)  # prefill logprobs: no prefix lookup
    _, batch = q.next_batch(None, None, 100, 400)
    assert batch.requests[0].cache_len == 0


def test_queue_padded_mode_counts_rejected_entry():
    q = _queue(requires_padding=True, block_size=1)
    _push(q, 10, max_new_tokens=5)
    _push(q, 20, max_new_tokens=5)
    entries, batch = q.next_batch(None, None, 30, 1000)
    assert list(entries) == [0]
    assert batch.requests[0].blocks == [] and batch.requests[0].slots == []
    assert batch.max_tokens == 2 * 20 + 10  # the rejected entry stays in the sums (stock quirk)


def test_warmup_request_shape():
    req = build_warmup_request(max_input_tokens=300, max_prefill_tokens=1000, max_total_tokens=400, max_batch_size=None)
    reqs = req.batch.requests
    assert [r.truncate for r in reqs] == [300, 300, 300, 100]
    assert all(r.id == 0 and not r.blocks and not r.slots and r.cache_len == 0 for r in reqs)
    assert all(not r.HasField("chunk_len") and r.prefill_logprobs and r.top_n_tokens == 20 for r in reqs)
    assert [r.stopping_parameters.max_new_tokens for r in reqs] == [100, 100, 100, 300]
    assert all(r.stopping_parameters.ignore_eos_token and r.add_special_tokens for r in reqs)
    first = reqs[0]
    kinds = [c.WhichOneof("chunk") for c in first.input_chunks.chunks]
    assert kinds == ["text", "image"]
    assert first.input_chunks.chunks[1].image.data.startswith(b"\x89PNG")
    assert first.input_chunks.chunks[1].image.mimetype == "image/jpeg;base64"
    assert first.inputs.startswith("_test " * 300) and first.inputs.endswith(")")
    assert [c.WhichOneof("chunk") for c in reqs[1].input_chunks.chunks] == ["text"]
    assert reqs[1].inputs == "_test " * 300
    p = first.parameters
    assert (p.do_sample, p.seed, p.watermark, p.top_k) == (False, 0, True, 10)
    assert req.batch.id == 0 and req.batch.size == 4 and req.batch.max_tokens == 300 and req.batch.max_blocks == 0
    assert req.max_input_tokens == 300 and req.max_prefill_tokens == 1000 and req.max_total_tokens == 400

    bare = build_warmup_request(None, 512, None, None)
    assert len(bare.batch.requests) == 1 and bare.batch.requests[0].truncate == 512
    assert bare.batch.requests[0].stopping_parameters.max_new_tokens == 1
    assert not bare.HasField("max_input_tokens") and not bare.HasField("max_total_tokens")
    assert bare.batch.max_tokens == 0
    capped = build_warmup_request(10, 100, None, 3)
    assert len(capped.batch.requests) == 3


def test_liveness_batch_shape():
    batch = build_liveness_batch()
    (r,) = batch.requests
    assert batch.id == r.id == 2**64 - 1 and batch.max_tokens == 2 and batch.max_blocks == 1
    assert (r.inputs, r.truncate, list(r.blocks), list(r.slots)) == ("liveness", 1, [0], [0])
    assert r.stopping_parameters.max_new_tokens == 1 and not r.add_special_tokens and r.cache_len == 0


def test_limit_derivation_and_startup_checks():
    kw = dict(max_input_tokens=None, max_total_tokens=None, max_batch_prefill_tokens=4096, max_batch_total_tokens=None)
    assert derive_limits((50000, 4095, 4096), **kw) == (50000, 4095, 4096)
    assert derive_limits((None, 4095, 4096), **kw) == (16000, 4095, 4096)
    assert derive_limits((None, 4095, 4096), **{**kw, "max_batch_total_tokens": 9000})[0] == 9000
    assert derive_limits((60000, 10, 20), **{**kw, "max_batch_total_tokens": 9000})[0] == 60000
    with pytest.raises(RouterStartupError, match="Not enough memory"):
        derive_limits((1000, 4095, 4096), **kw)
    with pytest.raises(RouterStartupError, match="assertion"):
        derive_limits((50000, 4095, 4096), **{**kw, "max_input_tokens": 100})
    check_startup_args(100, 200, 100, 1000, False)
    for args, msg in [
        ((200, 200, 4096, 9000, False), "must be < `max_total_tokens`"),
        ((300, 400, 200, 9000, False), "`max_batch_prefill_tokens` must be >= `max_input_tokens`"),
        ((100, 400, 5000, 4000, True), "must be <= `max_batch_total_tokens`"),
        ((100, 5000, 100, 4000, True), "`max_total_tokens` must be <="),
    ]:
        with pytest.raises(RouterStartupError, match=msg.replace("`", ".")):
            check_startup_args(*args)
    check_startup_args(300, 400, 200, 9000, True)  # chunking skips the prefill >= input check


def test_pb_request_fields_from_queue():
    q = _queue()
    entry = Entry(_valid(range(5)), ResponseChannel(), 0.0)
    entry.request.grammar = "[ab]+"
    entry.request.adapter_id = "dummy"
    q.append(entry)
    _, batch = q.next_batch(None, None, 100, 400)
    r = batch.requests[0]
    assert r.inputs == "xxxxx" and [c.text for c in r.input_chunks.chunks] == ["xxxxx"]
    assert r.parameters.grammar_type == pb.GRAMMAR_TYPE_REGEX and r.adapter_id == "dummy"
    assert r.parameters.seed == 3 and r.truncate == 100


def test_queue_stop_reason_tells_memory_from_prefill_budget():
    """``stop_reason`` (a benchmark aid, not stock behaviour) says why entries were left behind."""
    q = _queue(max_batch_total_tokens=40)  # 10 blocks of 4
    assert q.next_batch(None, None, 100, 400) is None and q.stop_reason is None  # empty queue
    _push(q, 6)
    _push(q, 6)
    _push(q, 6)
    entries, _ = q.next_batch(None, None, 100, 400)  # 3 blocks each: the fourth would not fit
    assert list(entries) == [0, 1, 2] and q.stop_reason is None
    _push(q, 6)
    assert q.next_batch(None, None, 100, 400) is None and q.stop_reason == "kv"  # 1 free block
    assert q.next_batch(None, None, 100, 0) is None and q.stop_reason == "kv"  # token budget spent
    q2 = _queue()
    _push(q2, 30)
    assert q2.next_batch(None, None, 16, 400) is None and q2.stop_reason == "prefill"
    assert q2.next_batch(None, None, 0, 400) is None and q2.stop_reason == "prefill"
    assert q2.next_batch(2, None, 100, 400) is None and q2.stop_reason == "size"
