"""Greedy output of the shard engine is token-identical to HF ``generate`` (tiny Llama, Qwen2, Mistral).

Every scenario drives the engine the way the router does (``RouterDriver``: one final Generation per
request, FilterBatch/ClearCache after finals, invariants after every RPC) and most give requests the
router's virtual ``blocks``/``slots`` reservations. Scenarios: one request; a mixed batch of different
prompt lengths; a batch joining mid-flight in chunking mode (``prefill(new, cached_batch_id)``) and in
non-chunking mode (separate prefill, then ``decode([running, new])``); chunked prefill (small
``max_prefill_tokens`` from Warmup, router ``chunk_len`` on the last request, server continuation, a
long request joining with the router's leftover budget); prefix reuse after a request finished (no
router hit, a router hit with ``cache_len``, and a router hit on blocks the shard already reclaimed);
a physical pool small enough that requests are preempted by recompute or by swap. The preemption and
prefix-reuse scenarios run again at block sizes 1 (stock TGI's flashinfer layout, a block per token)
and 2.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import (
    TINY_KIND_FIXTURES,
    RouterBlocks,
    RouterDriver,
    make_engine,
    make_text,
    prompt_ids,
    router_spec,
    router_warmup,
    spec,
)
from tgi_paged_backend.engine.types import BatchSpec, FinishReason


def expect_hf(engine, hf_greedy, model_dir, driver: RouterDriver, requests) -> None:
    for r in requests:
        ids = prompt_ids(engine, r.text, r.truncate, r.add_special_tokens)
        want = hf_greedy(model_dir, ids, r.stopping.max_new_tokens)
        assert driver.tokens[r.id] == want, f"request {r.id} (prompt {len(ids)} tokens) differs from HF"
        assert driver.final[r.id].generated_text.finish_reason is FinishReason.LENGTH


def test_single_request(tiny_dir, hf_greedy):
    engine = make_engine(tiny_dir, num_blocks=16)
    driver = RouterDriver(engine)
    r = spec(1, "The quick brown fox jumps over the lazy dog.", 12)
    driver.run(BatchSpec(id=0, requests=(r,)))
    expect_hf(engine, hf_greedy, tiny_dir, driver, [r])
    driver.assert_idle()


def test_mixed_batch_with_router_reservations(tiny_dir, hf_greedy):
    engine = make_engine(tiny_dir, num_blocks=40)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [
        router_spec(engine, blocks, rid, make_text(rid, words), max_new)
        for rid, words, max_new in ((1, 3, 9), (2, 22, 6), (3, 11, 12), (4, 1, 4))
    ]
    lengths = {len(prompt_ids(engine, r.text)) for r in requests}
    assert len(lengths) == 4, "prompts must differ in length"
    driver.run(BatchSpec(id=7, requests=tuple(requests)))
    expect_hf(engine, hf_greedy, tiny_dir, driver, requests)
    driver.assert_idle()
    assert sorted(blocks.free) == list(range(1, engine.num_virtual_blocks))


@pytest.mark.parametrize("mode", ["chunking", "non_chunking"])
def test_batch_joins_mid_flight(tiny_dir, hf_greedy, mode):
    engine = make_engine(tiny_dir, num_blocks=40)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    first = [
        router_spec(engine, blocks, 10, make_text(10, 12), 12),
        router_spec(engine, blocks, 11, make_text(11, 4), 10),
    ]
    running = driver.prefill(BatchSpec(id=0, requests=tuple(first)))
    for _ in range(3):
        running = driver.decode([running])
    assert set(running.request_ids) == {10, 11}
    late = [router_spec(engine, blocks, 12, make_text(12, 17), 8), router_spec(engine, blocks, 13, make_text(13, 6), 5)]
    new = BatchSpec(id=1, requests=tuple(late))
    if mode == "chunking":
        running = driver.prefill(new, cached=running)
        assert running.id == 0 and set(running.request_ids) == {10, 11, 12, 13}
        assert [g.request_id for g in driver.results[-1].generations].count(10) == 1
    else:
        new_batch = driver.prefill(new)
        assert new_batch.id == 1 and set(new_batch.request_ids) == {12, 13}
        assert set(running.request_ids) == {10, 11}
        running = driver.decode([running, new_batch])
        assert running.id == 0 and set(running.request_ids) == {10, 11, 12, 13}
        assert list(engine.batches) == [0]
    driver.drain(running)
    expect_hf(engine, hf_greedy, tiny_dir, driver, first + late)
    driver.assert_idle()


def test_chunked_prefill_router_chunk_len_and_server_continuation(tiny_dir, hf_greedy):
    budget = 32  # the router's max_batch_prefill_tokens, told to the shard in Warmup
    engine = make_engine(tiny_dir, num_blocks=48)
    router_warmup(engine, budget)
    assert engine.capacity.max_prefill_tokens == budget
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    short = router_spec(engine, blocks, 20, make_text(21, 3), 10)
    n_short = len(prompt_ids(engine, short.text))
    long_text, later_text = make_text(20, 30), make_text(22, 40)
    assert len(prompt_ids(engine, long_text)) > 3 * budget and len(prompt_ids(engine, later_text)) > 3 * budget
    # The router's batch fills the prefill budget: the last request gets chunk_len.
    long = router_spec(engine, blocks, 21, long_text, 6, chunk_len=budget - n_short)
    batch = driver.prefill(BatchSpec(id=3, requests=(short, long)))
    assert {g.request_id for g in driver.results[-1].generations} == {20}  # 21 prefills: no Generation
    assert batch.request_ids == [20, 21] and engine.requests[21].num_computed == budget - n_short
    assert batch.current_tokens >= budget  # the router adds no prefill while the chunks continue

    def step(batch, new=None):
        before = {rid: engine.requests[rid].num_computed for rid in batch.request_ids}
        batch = driver.prefill(new, cached=batch) if new else driver.decode([batch])
        assert (
            sum(engine.requests[rid].num_computed - n for rid, n in before.items() if rid in engine.requests) <= budget
        )
        return batch

    while not driver.tokens[21]:  # server-side continuation
        batch = step(batch)
    assert len(driver.results) >= 4
    assert batch.current_tokens < budget
    # A new long request joins with the budget the router has left (chunking mode).
    later = router_spec(engine, blocks, 22, later_text, 6, chunk_len=budget - batch.current_tokens)
    batch = step(batch, BatchSpec(id=4, requests=(later,)))
    joined = len(driver.results) - 1
    # (Mistral: 21's prompt blocks behind the window are already retained, so a BOS copy-on-write may hit.)
    cached = engine.requests[22].num_cached_prompt
    assert batch.id == 3 and engine.requests[22].num_computed == later.chunk_len + cached and not driver.tokens[22]
    while batch is not None:
        batch = step(batch)
    first = next(i for i, res in enumerate(driver.results) if 22 in {g.request_id for g in res.generations})
    assert first - joined >= 3  # three or more forwards for its prompt
    expect_hf(engine, hf_greedy, tiny_dir, driver, [short, long, later])
    driver.assert_idle()


@pytest.mark.parametrize(
    ("kind", "router_prefix_hit", "block_size"),
    [
        ("llama", "none", 8),
        ("qwen2", "none", 8),
        ("mistral", "none", 8),
        ("llama", "hit", 8),
        ("llama", "hit_but_evicted", 8),
        ("llama", "none", 1),
        ("mistral", "hit", 1),
        ("llama", "hit", 2),
    ],
)
def test_prefix_reuse_after_finish(request, hf_greedy, kind, router_prefix_hit, block_size):
    tiny_dir = request.getfixturevalue(TINY_KIND_FIXTURES[kind])
    engine = make_engine(tiny_dir, num_blocks=32 * 8 // block_size, block_size=block_size)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    text = make_text(30, 30)
    n = len(prompt_ids(engine, text))
    first = router_spec(engine, blocks, 1, text, 6)
    driver.run(BatchSpec(id=0, requests=(first,)))
    assert engine.kv.num_retained_blocks >= n // engine.block_size
    if router_prefix_hit == "hit_but_evicted":  # the shard reclaimed them; the router does not know
        assert engine.kv.reset_prefix_cache() > 0
    hits_before = engine.stats.prefix_hit_tokens
    if router_prefix_hit != "none":  # RadixAllocator: prefix blocks come back, cache_len = full blocks
        k = (n - 1) // engine.block_size
        prefix = first.blocks[:k]
        blocks.free = [b for b in blocks.free if b not in prefix]
        fresh, _ = blocks.allocate(n + 6 - 1 - k * engine.block_size)
        all_blocks = prefix + fresh
        slots = tuple(b * engine.block_size + o for b in all_blocks for o in range(engine.block_size))[: n + 5]
        second = spec(2, text, 6, blocks=all_blocks, slots=slots, cache_len=k * engine.block_size)
    else:
        second = router_spec(engine, blocks, 2, text, 6)
    driver.run(BatchSpec(id=1, requests=(second,)))
    if router_prefix_hit == "hit_but_evicted":  # recomputed silently
        assert engine.stats.prefix_hit_tokens == hits_before
    else:
        assert engine.stats.prefix_hit_tokens - hits_before >= (n - 1) // engine.block_size * engine.block_size
    assert driver.tokens[2] == driver.tokens[1]
    expect_hf(engine, hf_greedy, tiny_dir, driver, [first, second])
    driver.assert_idle()


@pytest.mark.parametrize("block_size", [8, 1, 2])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(tiny_dir, hf_greedy, mode, block_size):
    # 64 physical tokens (block 0 is scratch); four requests of ~12 + 20 tokens need ~128, so decoding
    # must preempt. At block size 8 the four prompts (2 blocks each) fill the pool in the first step, so
    # every block boundary an older request crosses afterwards takes blocks from a younger one. Block
    # size 1 is stock TGI's flashinfer layout: a block per token, router slots == router block ids.
    engine = make_engine(
        tiny_dir, num_blocks=64 // block_size + 1, block_size=block_size, preemption=mode, TGI_PAGED_OVERCOMMIT="3"
    )
    assert engine.block_size == block_size
    result = router_warmup(engine, 64)
    assert result.max_supported_total_tokens == 3 * 64
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [router_spec(engine, blocks, rid, make_text(rid, 3), 20) for rid in (40, 41, 42, 44)]
    lengths = [len(prompt_ids(engine, r.text)) for r in requests]
    assert all(9 <= n <= 16 for n in lengths)
    for r, n in zip(requests, lengths):  # the router reserved prompt + 20 - 1 slots in whole blocks
        assert len(r.slots) == n + 19 and len(r.blocks) == -(-(n + 19) // block_size)
        if block_size == 1:
            assert r.slots == r.blocks
    batch = driver.prefill(BatchSpec(id=5, requests=tuple(requests)))
    # Each prompt is backed by exactly ceil(n / block_size) physical blocks (lazy: not its reservation);
    # the rest of the pool is free (none at block size 8).
    used = sum(-(-n // block_size) for n in lengths)
    assert engine.kv.num_used_blocks == used
    assert engine.kv.num_free_blocks == 64 // block_size - used
    default_copy_rate = engine.calibrator.copy_bytes_per_s
    driver.drain(batch)
    assert engine.stats.preemptions[mode] > 0, engine.stats.preemptions
    if mode == "swap":
        assert engine.stats.swap_bytes["in"] == engine.stats.swap_bytes["out"] > 0
        # the swap-vs-recompute cost model learns the measured copy rate from production swaps
        assert engine.calibrator.copy_bytes_per_s != default_copy_rate
    expect_hf(engine, hf_greedy, tiny_dir, driver, requests)
    driver.assert_idle()
    assert engine.kv.num_swapped_blocks == 0
