"""Router protocol: FilterBatch, ClearCache, the liveness probe, Warmup and the admission brake."""

from __future__ import annotations

import pytest

from tests.engine.conftest import (
    RouterBlocks,
    RouterDriver,
    make_engine,
    make_text,
    probe,
    prompt_ids,
    router_spec,
    router_warmup,
    spec,
    warmup_batch,
)
from tgi_paged_backend.config import ConfigError
from tgi_paged_backend.engine.request_state import RequestStatus
from tgi_paged_backend.engine.types import U64_MAX, BatchSpec, InvalidRequestError

# ------------------------------------------------------------------------------- filter / clear


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_filter_batch_keeps_exactly_the_given_ids_and_frees_the_rest(tiny_llama_dir, hf_greedy, preemption):
    # 9 blocks: four 2-block prompts fill the pool, so the youngest get preempted (swapped) soon.
    engine = make_engine(tiny_llama_dir, num_blocks=9, preemption=preemption)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [router_spec(engine, blocks, rid, make_text(rid, 3), 16) for rid in (40, 41, 42, 44)]
    batch = driver.prefill(BatchSpec(id=3, requests=tuple(requests)))
    while not any(r.is_preempted for r in engine.requests.values()):
        batch = driver.decode([batch])
    victim = next(rid for rid, r in engine.requests.items() if r.is_preempted)
    drop = {victim, 41} - {40}
    kept = [rid for rid in batch.request_ids if rid not in drop]
    for rid in drop:  # the router drops cancelled entries and frees their blocks first
        del driver.entries[rid]
        blocks.release(next(r.blocks for r in requests if r.id == rid))
    info = engine.filter_batch(batch.id, kept)
    engine.kv.check_invariants()
    assert info.id == batch.id and info.request_ids == kept
    assert set(engine.requests) == set(kept) and all(rid not in engine.kv for rid in drop)
    if preemption == "swap":
        assert engine.kv.num_swapped_blocks == sum(len(engine.kv._requests[rid].swapped or ()) for rid in kept)
    assert engine.filter_batch(batch.id, kept).request_ids == kept  # same membership: unchanged
    driver.drain(info)
    driver.assert_idle()
    assert engine.kv.num_swapped_blocks == 0
    for r in requests:
        if r.id in kept:
            assert driver.tokens[r.id] == hf_greedy(tiny_llama_dir, engine.prompt_tokenizer.encode(r.text, 10_000), 16)


def test_clear_cache_unknown_one_and_all(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=32)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    a = driver.prefill(BatchSpec(id=1, requests=(router_spec(engine, blocks, 1, make_text(1, 5), 9),)))
    b = driver.prefill(
        BatchSpec(
            id=2,
            requests=(
                router_spec(engine, blocks, 2, make_text(2, 5), 9),
                router_spec(engine, blocks, 3, make_text(3, 2), 9),
            ),
        )
    )
    c = driver.prefill(BatchSpec(id=3, requests=(router_spec(engine, blocks, 4, make_text(4, 9), 9),)))
    used = engine.kv.num_used_blocks
    engine.clear_cache(12345)  # unknown: silent
    engine.clear_cache(U64_MAX)
    assert engine.kv.num_used_blocks == used and set(engine.batches) == {1, 2, 3}
    engine.clear_cache(b.id)
    engine.kv.check_invariants()
    assert set(engine.batches) == {1, 3} and set(engine.requests) == {1, 4}
    assert engine.kv.num_used_blocks < used
    a = driver.decode([a, c])  # the others are untouched
    assert a.request_ids == [1, 4]
    engine.clear_cache(None)
    engine.kv.check_invariants()
    assert engine.batches == {} and engine.requests == {} and engine.kv.num_used_blocks == 0
    engine.clear_cache(None)  # idempotent


def test_failed_merged_prefill_releases_the_cached_batch(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=32)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    running = driver.prefill(BatchSpec(id=1, requests=(router_spec(engine, blocks, 1, make_text(1, 5), 9),)))
    bad = BatchSpec(id=2, requests=(spec(2, "", 4),))
    with pytest.raises(InvalidRequestError):
        engine.prefill(bad, running.id)
    engine.clear_cache(bad.id)  # all the router does after a failed Prefill in chunking mode
    assert engine.requests == {} and engine.kv.num_used_blocks == 0


# ---------------------------------------------------------------------------------------- liveness


def test_liveness_probe_idle_with_cached_batch_and_with_a_full_pool(tiny_llama_dir, hf_greedy):
    engine = make_engine(tiny_llama_dir, num_blocks=9, preemption="swap")
    probe(engine)
    assert engine.kv.num_used_blocks == 0
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [router_spec(engine, blocks, rid, make_text(rid, 3), 12) for rid in (40, 41, 42, 44)]
    batch = driver.prefill(BatchSpec(id=3, requests=tuple(requests)))
    assert engine.kv.num_free_blocks == 0 and engine.kv.num_retained_blocks == 0  # every block in use
    probe(engine)
    full_seen = preempted_seen = False
    while batch is not None:
        batch = driver.decode([batch])
        probe(engine)
        full_seen |= engine.kv.num_available_blocks == 0
        preempted_seen |= any(r.is_preempted for r in engine.requests.values())
    assert full_seen and preempted_seen
    driver.assert_idle()
    for r in requests:
        assert driver.tokens[r.id] == hf_greedy(tiny_llama_dir, engine.prompt_tokenizer.encode(r.text, 10_000), 12)
    probe(engine)
    assert engine.kv.num_used_blocks == 0


# ------------------------------------------------------------------------------------------ warmup


def test_warmup_router_batch_echoes_limits_and_advertises_overcommit(tiny_qwen2_dir):
    engine = make_engine(tiny_qwen2_dir, num_blocks=20, TGI_PAGED_OVERCOMMIT="2.5")
    batch = warmup_batch(40, max_input_tokens=16, max_total_tokens=64)
    assert len(batch.requests) == 3 and {r.id for r in batch.requests} == {0}
    assert sum(r.truncate for r in batch.requests) == 40
    result = engine.warmup(batch, max_input_tokens=16, max_prefill_tokens=40, max_total_tokens=64)
    physical = (20 - 1) * 8
    assert (result.max_input_tokens, result.max_total_tokens) == (16, 64)
    assert result.max_supported_total_tokens == int(physical * 2.5) // 8 * 8 == 376
    assert result.max_supported_total_tokens >= result.max_total_tokens
    assert engine.batches == {} and engine.requests == {} and engine.kv.num_used_blocks == 0
    assert engine.num_virtual_blocks == 376 // 8
    # Idempotent (a restarted router warms up again), and the engine serves afterwards.
    again = engine.warmup(batch, max_input_tokens=16, max_prefill_tokens=40, max_total_tokens=64)
    assert again == result
    driver = RouterDriver(engine, RouterBlocks(engine))
    driver.run(BatchSpec(id=1, requests=(router_spec(engine, driver.blocks, 1, make_text(1, 4), 5),)))
    driver.assert_idle()


def test_warmup_without_limits_picks_consistent_defaults(tiny_qwen2_dir):
    engine = make_engine(tiny_qwen2_dir, num_blocks=20)
    result = router_warmup(engine, 32)
    assert 0 < result.max_input_tokens < result.max_total_tokens <= result.max_supported_total_tokens
    assert result.max_total_tokens <= 19 * 8  # one request of max_total_tokens fits physically
    assert result.max_supported_total_tokens % 8 == 0 and result.max_supported_total_tokens >= 32
    assert engine.kv.num_used_blocks == 0 and engine.requests == {}


def test_warmup_rejects_max_total_tokens_that_cannot_fit(tiny_qwen2_dir):
    engine = make_engine(tiny_qwen2_dir, num_blocks=10)  # 9 usable blocks = 72 tokens
    with pytest.raises(ConfigError, match="TGI_PAGED_NUM_BLOCKS"):
        router_warmup(engine, 32, max_input_tokens=60, max_total_tokens=100)
    assert engine.requests == {} and engine.batches == {} and engine.kv.num_used_blocks == 0
    ok = router_warmup(engine, 32, max_input_tokens=40, max_total_tokens=72)
    assert ok.max_total_tokens == 72 and ok.max_supported_total_tokens >= 72


# ------------------------------------------------------------------------------- admission brake


def test_admission_brake_while_pool_is_short_or_requests_preempted(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=9, preemption="recompute")
    result = router_warmup(engine, 64)
    supported = result.max_supported_total_tokens
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    # Alone on an empty pool: the true reservation (stock's num_blocks * BLOCK_SIZE), no brake.
    first = router_spec(engine, blocks, 1, make_text(1, 2), 4)
    batch = driver.prefill(BatchSpec(id=0, requests=(first,)))
    assert batch.max_tokens == len(first.blocks) * engine.block_size < supported
    driver.drain(batch)
    requests = [router_spec(engine, blocks, rid, make_text(rid, 3), 16) for rid in (40, 41, 42, 44)]
    batch = driver.prefill(BatchSpec(id=1, requests=tuple(requests)))
    braked = 0
    while batch is not None:
        waiting = any(r.status in (RequestStatus.SWAPPED, RequestStatus.PREEMPTED) for r in engine.requests.values())
        if waiting or engine.kv.num_available_blocks == 0:
            assert batch.max_tokens >= supported
            assert batch.current_tokens >= engine.capacity.max_prefill_tokens
            braked += waiting
        batch = driver.decode([batch])
    assert braked > 0
    driver.assert_idle()


def test_request_without_blocks_is_reported_waiting_then_runs(tiny_llama_dir):
    """Two prompts that cannot both fit: the younger keeps its place without blocks (never taking the
    older one's), the step record counts it as waiting for memory, and it runs once blocks free."""
    engine = make_engine(
        tiny_llama_dir,
        num_blocks=9,
        block_size=8,  # 8 usable blocks = 64 slots
        TGI_PAGED_OVERCOMMIT="8",
    )
    router_warmup(engine, 64)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)

    def text_of(rid: int) -> str:  # a prompt of 33..60 tokens: 5+ of the 8 blocks each
        return next(t for n in range(4, 60) if 33 <= len(prompt_ids(engine, t := make_text(rid, n))) <= 60)

    old, young = (router_spec(engine, blocks, rid, text_of(rid), 3) for rid in (1, 2))
    batch = driver.prefill(BatchSpec(id=0, requests=(old, young)))
    assert engine.requests[2].waiting_for_blocks and not engine.requests[1].waiting_for_blocks
    assert engine.last_step.num_waiting == 1 and engine.last_step.num_preempted == 0
    assert driver.generations[2] == [] and len(driver.generations[1]) == 1
    driver.drain(batch)
    assert engine.last_step.num_waiting == 0
    assert len(driver.tokens[2]) == 3
    driver.assert_idle()
