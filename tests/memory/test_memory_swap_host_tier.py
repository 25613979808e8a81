"""Swap preemption shares the host tier (issue 42 item 4): a swapped-out request's blocks whose KV a
landed host entry holds are not copied to swap space; their entries stay pinned while it is out, and
swap-in loads them back from the host tier. Contents are checked with the code simulator."""

from __future__ import annotations

import pytest

from tests.memory.memory_sim import KVSim
from tgi_paged_backend.memory.kv_cache_manager import KVCacheManager
from tgi_paged_backend.memory.prefix_tiers import TierSetup

BS = 4
PROMPT = list(range(100, 100 + 3 * BS + 2))  # 3 full blocks and a partial one


def _setup(groups=None, host_rows: int = 8, swap_blocks: int = 8, num_blocks: int = 9):
    kw = {"groups": groups} if groups else {}
    m = KVCacheManager(
        num_blocks=num_blocks, block_size=BS, num_swap_blocks=swap_blocks, tiers=TierSetup(host_rows, b"s"), **kw
    )
    return m, KVSim(num_blocks, BS, swap_blocks, host_rows)


def _prefill(m: KVCacheManager, sim: KVSim, rid: int, tokens: list[int]) -> int:
    m.add_request(rid)
    cached = m.match_prefix(rid, tokens).num_cached_tokens
    sim.apply_tier_moves(m)
    allocation = m.allocate(rid, len(tokens))
    assert allocation is not None
    sim.apply_tier_moves(m)
    sim.apply_allocation(allocation)
    sim.write(m, rid, tokens, cached, len(tokens))
    m.commit_tokens(rid, tokens)
    return cached


def _prefix_in_host_tier(m: KVCacheManager, sim: KVSim) -> None:
    """A first request leaves PROMPT's 3 full blocks retained; ClearCache pushes them to the host tier."""
    _prefill(m, sim, 1, PROMPT)
    m.free(1)
    m.reset_prefix_cache()
    sim.apply_tier_moves(m)
    assert m.tiers is not None and m.tiers.counters.offloaded_blocks == 3


@pytest.mark.parametrize(
    ("groups", "host_rows"), [(None, 6), ((None, 2 * BS), 10)], ids=["one group", "full + sliding"]
)
def test_swap_out_leaves_host_held_blocks_and_swap_in_loads_them(groups, host_rows):
    m, sim = _setup(groups, host_rows=host_rows)
    tiers = m.tiers
    assert tiers is not None
    _prefix_in_host_tier(m, sim)
    assert _prefill(m, sim, 2, PROMPT) == 3 * BS  # loaded back from the host tier
    used_before = m.num_swapped_blocks
    plan = m.swap_out(2)
    assert plan is not None
    sim.apply_swap(plan)
    kept = tiers.counters.swap_kept_rows
    live = 4 * m.num_groups  # every group's 4 blocks (a sliding group may have holes)
    assert kept >= 3, "the 3 prefix blocks the host tier holds were copied to swap space again"
    assert m.num_swapped_blocks - used_before == plan.num_blocks
    assert plan.num_blocks + kept <= live
    m.check_invariants()
    # The pinned entries survive a host tier under pressure: other prefixes evicted into it.
    for rid in range(10, 14):
        _prefill(m, sim, rid, list(range(1000 * rid, 1000 * rid + 2 * BS + 1)))
        m.free(rid)
    m.reset_prefix_cache()
    sim.apply_tier_moves(m)
    tiers.host.check_invariants()
    assert tiers.host.num_evicted > 0, "the host tier was never under pressure"
    plan = m.swap_in(2)
    assert plan is not None
    loads = sim.tier_moves["load"]
    sim.apply_tier_moves(m)
    assert sim.tier_moves["load"] == loads + 1, "swap-in did not load the kept blocks from the host tier"
    sim.apply_swap(plan)
    sim.assert_holds(m, 2, PROMPT, len(PROMPT))
    m.check_invariants()
    m.free(2)
    assert not tiers.host._pinned, "swap-in left host entries pinned"


def test_free_while_swapped_unpins_and_nothing_leaks():
    m, sim = _setup()
    tiers = m.tiers
    assert tiers is not None
    _prefix_in_host_tier(m, sim)
    _prefill(m, sim, 2, PROMPT)
    plan = m.swap_out(2)
    assert plan is not None and plan.num_blocks == 1  # only the partial block goes to swap space
    assert m.request_memory(2).num_blocks == 4
    m.free(2)
    assert not tiers.host._pinned and m.num_swapped_blocks == 0
    m.check_invariants()


def test_swap_out_without_swap_space_when_the_host_tier_holds_every_block():
    """Every live block in the host tier: swapping needs no swap space at all."""
    m, sim = _setup(swap_blocks=0)
    _prefix_in_host_tier(m, sim)
    full = PROMPT[: 3 * BS + 1]  # 3 full blocks and one token
    m.add_request(2)
    m.match_prefix(2, full)
    sim.apply_tier_moves(m)
    assert m.allocate(2, 3 * BS) is not None  # back only the 3 full blocks
    m.commit_tokens(2, full[: 3 * BS])
    assert m.can_swap_out(2)
    plan = m.swap_out(2)
    assert plan is not None and plan.num_blocks == 0
    plan = m.swap_in(2)
    assert plan is not None
    sim.apply_tier_moves(m)
    sim.assert_holds(m, 2, full, 3 * BS)
    m.check_invariants()


def test_a_block_the_host_tier_lacks_goes_to_swap_space():
    """Without a host copy nothing changes: every live block is copied to swap space."""
    m, sim = _setup()
    _prefill(m, sim, 2, PROMPT)
    plan = m.swap_out(2)
    assert plan is not None and plan.num_blocks == 4
    assert m.tiers is not None and m.tiers.counters.swap_kept_rows == 0
