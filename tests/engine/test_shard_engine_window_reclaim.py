"""Sliding-window block reclaim through the shard engine: a tiny Mistral whose every layer sees the
last 8 tokens, block size 4, generating far past the window on a pool smaller than one request's
history, with preemption by recompute and by swap -- token-exact against HF ``generate``, with each
request's physical blocks bounded by what its window reads."""

from __future__ import annotations

import pytest

from tests.engine.conftest import (
    RouterBlocks,
    RouterDriver,
    make_engine,
    make_text,
    prompt_ids,
    router_spec,
    router_warmup,
)
from tests.helpers.triton_serving import LAUNCHERS, route_to_triton
from tgi_paged_backend.config import ConfigError
from tgi_paged_backend.engine.capacity import plan_capacity
from tgi_paged_backend.engine.request_state import RequestStatus
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.memory.window_reclaim import max_resident_blocks

WINDOW = 8
BLOCK_SIZE = 4
PREFILL = 16


@pytest.fixture(scope="module")
def windowed_mistral_dir(tiny_model_factory):
    return tiny_model_factory("mistral", sliding_window=WINDOW)


def test_warmup_needs_only_the_window_of_one_request():
    def plan(window):
        return plan_capacity(
            available_kv_bytes=10**9,
            block_bytes=1000,
            block_size=BLOCK_SIZE,
            num_blocks_cap=9,
            overcommit=4,
            max_position_embeddings=512,
            max_input_tokens=None,
            max_total_tokens=64,
            max_prefill_tokens=PREFILL,
            reclaim_window=window,
        )

    with pytest.raises(ConfigError, match="needs 17 KV blocks"):
        plan(None)  # 64 tokens = 16 blocks + scratch > 9
    assert plan(WINDOW).num_blocks == 9  # a 16-token chunk reads 23 positions: 7 blocks + scratch


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_generation_far_past_the_window_is_exact_on_a_pool_smaller_than_one_history(
    windowed_mistral_dir, hf_greedy, mode
):
    engine = make_engine(
        windowed_mistral_dir, num_blocks=9, block_size=BLOCK_SIZE, preemption=mode, TGI_PAGED_OVERCOMMIT="8"
    )
    assert engine.kv.reclaim_window == WINDOW
    assert engine.info().window_size is None  # the router keeps reserving whole histories
    router_warmup(engine, PREFILL, max_total_tokens=64)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [router_spec(engine, blocks, rid, make_text(rid, 4), 40) for rid in (1, 2, 3)]
    lengths = [len(prompt_ids(engine, r.text)) for r in requests]
    assert all(n + 40 > 8 * BLOCK_SIZE for n in lengths)  # every history outgrows the 8-block pool
    chunk_bound = max_resident_blocks(WINDOW, BLOCK_SIZE, PREFILL)
    decode_bound = max_resident_blocks(WINDOW, BLOCK_SIZE)  # ceil(W / bs) + 1 = 3
    holes_seen = 0
    produced_before: set[int] = set()
    batch = driver.prefill(BatchSpec(id=0, requests=tuple(requests)))
    for _ in range(500):
        if batch is None:
            break
        batch = driver.decode([batch])
        produced = {g.request_id for g in driver.results[-1].generations}
        for rid, state in engine.requests.items():
            if state.status is not RequestStatus.RUNNING:
                continue
            held = engine.kv.request_memory(rid).num_blocks
            assert held <= chunk_bound, (rid, held)
            if rid in produced and rid in produced_before:  # this step decoded one token
                assert held <= decode_bound, (rid, held)
        produced_before = produced
        holes_seen = max(holes_seen, engine.kv.stats().num_hole_blocks)
    assert batch is None
    for r in requests:
        assert driver.tokens[r.id] == hf_greedy(windowed_mistral_dir, prompt_ids(engine, r.text), 40), r.id
    assert engine.stats.preemptions[mode] > 0, engine.stats.preemptions
    if mode == "swap":
        assert engine.stats.swap_bytes["in"] == engine.stats.swap_bytes["out"] > 0
    stats = engine.kv.stats()
    assert holes_seen > 0 and stats.num_reclaimed_blocks_total > 3 * 8
    driver.assert_idle()
    assert engine.kv.num_swapped_blocks == 0


def test_triton_kernels_read_around_the_holes(windowed_mistral_dir, hf_greedy, monkeypatch):
    # The CUDA code path (store, prefill, decode through the Triton launchers, interpreted on CPU by
    # TRITON_INTERPRET=1 from the root conftest) over block tables whose leading entries are holes:
    # tile-aligned key ranges start before the window and touch the scratch block, masked out.
    calls = route_to_triton(monkeypatch)
    engine = make_engine(windowed_mistral_dir, num_blocks=16, block_size=BLOCK_SIZE, TGI_PAGED_OVERCOMMIT="4")
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [router_spec(engine, blocks, rid, make_text(rid, 3), 14) for rid in (1, 2)]
    driver.run(BatchSpec(id=0, requests=tuple(requests)))
    assert set(LAUNCHERS) <= set(calls)
    assert engine.kv.stats().num_reclaimed_blocks_total > 0
    for r in requests:
        assert driver.tokens[r.id] == hf_greedy(windowed_mistral_dir, prompt_ids(engine, r.text), 14), r.id
    driver.assert_idle()
