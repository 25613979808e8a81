"""KV layer groups through the shard engine (issue 24): a tiny Gemma 3 and a tiny gpt-oss (one sliding
layer of window 8 beside one full-attention layer) generate far past the window. The sliding group
keeps only its window, the full group every block; on a pool too small for every request's history in
both groups, requests are preempted by recompute and by swap, and greedy stays token-exact against HF.
With ``TGI_PAGED_LAYER_GROUPS=0`` the same memory cannot even hold one request."""

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
from tests.helpers.family_models import FAMILIES, write_family_model
from tgi_paged_backend.config import ConfigError
from tgi_paged_backend.engine.capacity import plan_capacity
from tgi_paged_backend.engine.request_state import RequestStatus
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.memory.window_reclaim import max_resident_blocks

WINDOW, BLOCK_SIZE, NEW = 8, 4, 40


@pytest.fixture(scope="module", params=["Gemma3", "gpt-oss"])
def hybrid_dir(request, tmp_path_factory):
    family = next(f for f in FAMILIES if f.name == request.param)
    assert family.overrides["sliding_window"] == WINDOW
    return write_family_model(family, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_generation_far_past_the_window_is_exact_with_the_sliding_group_bounded(hybrid_dir, hf_greedy, mode):
    # 3 requests of ~20 + 40 tokens: 15 blocks each in the full group, <= 3 in the sliding one; 30 usable
    # blocks hold two requests' groups, never three full histories in both groups (90)
    engine = make_engine(hybrid_dir, num_blocks=31, block_size=BLOCK_SIZE, preemption=mode, TGI_PAGED_OVERCOMMIT="8")
    assert engine.kv.num_groups == 2 and engine.kv.group_windows == (None, WINDOW)
    assert engine.runner.kv_groups.layers_per_block == 1  # a block holds one layer's K/V
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [router_spec(engine, blocks, rid, make_text(rid, 4), NEW) for rid in (1, 2, 3)]
    bound = max_resident_blocks(WINDOW, BLOCK_SIZE, 64)  # a prefill chunk reads its window plus itself
    batch = driver.prefill(BatchSpec(id=0, requests=tuple(requests)))
    for _ in range(500):
        if batch is None:
            break
        batch = driver.decode([batch])
        for rid, state in engine.requests.items():
            if state.status is RequestStatus.RUNNING:
                full, sliding = (m.num_physical_blocks for m in engine.kv._maps(rid))
                assert sliding <= min(full, bound), (rid, full, sliding)
    assert batch is None
    for r in requests:
        assert driver.tokens[r.id] == hf_greedy(hybrid_dir, prompt_ids(engine, r.text), NEW), r.id
    assert engine.stats.preemptions[mode] > 0, engine.stats.preemptions
    assert engine.kv.stats().num_reclaimed_blocks_total > 3 * 6
    driver.assert_idle()


def test_one_page_map_for_all_layers_needs_twice_the_memory(hybrid_dir):
    """Same memory, groups off: a block holds both layers, so 15 blocks; a 60-token request needs 16."""
    engine = make_engine(hybrid_dir, num_blocks=15, block_size=BLOCK_SIZE, TGI_PAGED_LAYER_GROUPS="0")
    assert engine.kv.num_groups == 1
    with pytest.raises(ConfigError, match="needs 16 KV blocks"):
        router_warmup(engine, 16, max_total_tokens=60)
    engine = make_engine(hybrid_dir, num_blocks=31, block_size=BLOCK_SIZE)
    router_warmup(
        engine, 16, max_total_tokens=60
    )  # 15 full + 3 sliding + scratch fit in 31  # 15 full + 3 sliding + scratch fit in 31


def test_warmup_budget_counts_what_the_sliding_groups_do_not_hold():
    """Gemma-2 shape (2 groups), window 4096, 8k-token requests, block size 16: every group keeping every
    block would need 2 x 512 blocks a request, the groups need 512 + 258 (the window and a 16-token
    chunk); the budget grows by that ratio."""
    groups = LayerGroups.from_layer_windows([4096, None] * 21)

    def plan(groups):
        return plan_capacity(
            available_kv_bytes=10**12,
            block_bytes=1000,
            block_size=16,
            num_blocks_cap=20_001,
            overcommit=1.0,
            max_position_embeddings=8192,
            max_input_tokens=4096,
            max_total_tokens=8192,
            max_prefill_tokens=1,
            groups=groups,
        )

    grouped, single = plan(groups), plan(None)
    assert grouped.physical_tokens == 20_000 // 2 * 16  # a position takes a block slot in both groups
    assert grouped.budget_gain == pytest.approx(1024 / 770)
    assert grouped.max_supported_total_tokens == pytest.approx(160_000 * 1024 / 770, abs=16)
    assert single.budget_gain == 1.0 and single.max_supported_total_tokens == 320_000


def test_a_follow_up_hits_the_prefix_in_every_group(hybrid_dir, hf_greedy):
    """A finished request's blocks are retained in both groups (the sliding group's registered as they
    left the window); a follow-up sharing its prompt hits them and stays token-exact."""
    engine = make_engine(hybrid_dir, num_blocks=64, block_size=BLOCK_SIZE)
    blocks = RouterBlocks(engine)
    first = router_spec(engine, blocks, 1, make_text(9, 6), 12)
    driver = RouterDriver(engine, blocks)
    driver.run(BatchSpec(id=0, requests=(first,)))
    follow_up = router_spec(engine, blocks, 2, make_text(9, 6) + " " + make_text(10, 2), 12)
    driver.run(BatchSpec(id=1, requests=(follow_up,)))
    assert engine.kv.stats().num_prefix_hit_tokens >= 2 * BLOCK_SIZE
    for r in (first, follow_up):
        assert driver.tokens[r.id] == hf_greedy(hybrid_dir, prompt_ids(engine, r.text), 12), r.id
    driver.assert_idle()
