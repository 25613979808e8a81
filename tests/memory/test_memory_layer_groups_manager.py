"""The manager with several layer groups (``KVCacheManager(groups=...)``, :mod:`.kv_group`): one page
map per group over one pool. A group of full attention keeps every block, a sliding group only its
window; allocation, swap, recompute, truncation and prefix hits move all groups together.

Each group's K/V is simulated with content codes salted by the group (a block read through the wrong
group's table shows), written and read through that group's slot mapping; invariants after every call.
"""

from __future__ import annotations

import numpy as np
import pytest
from memory_sim import KVSim, content_codes

from tgi_paged_backend.memory import KVCacheManager
from tgi_paged_backend.memory.window_reclaim import max_resident_blocks

BS, W = 4, 8
GROUPS = (None, W)  # full attention, then a sliding group (Gemma 2's shape)


class GroupSim(KVSim):
    """K/V codes per group: group ``g``'s code of a position is the history code plus ``g``."""

    def write_groups(self, m: KVCacheManager, rid: int, history, start: int, end: int) -> None:
        for g in range(m.num_groups):
            slots = m.slot_mapping([rid], [start], [end - start], group=g)
            self.device.reshape(-1)[slots] = content_codes(history)[start:end] + g

    def assert_groups_hold(self, m: KVCacheManager, rid: int, history) -> None:
        """Every full group reads the whole history back, every sliding group its latest query's window."""
        n = len(history)
        for g, window in enumerate(m.group_windows):
            start = 0 if window is None else max(n - window, 0)
            slots = m.slot_mapping([rid], [start], [n - start], group=g)
            got = self.device.reshape(-1)[slots]
            assert np.array_equal(got, content_codes(history)[start:n] + g), f"request {rid}, group {g}"


def make(num_blocks: int = 40, num_swap_blocks: int = 16, groups=GROUPS) -> tuple[KVCacheManager, GroupSim]:
    m = KVCacheManager(num_blocks=num_blocks, block_size=BS, num_swap_blocks=num_swap_blocks, groups=groups)
    return m, GroupSim(num_blocks, BS, num_swap_blocks)


def step(m: KVCacheManager, sim: GroupSim, rid: int, history: list[int], new: list[int]) -> bool:
    """Compute ``new`` tokens after ``history`` (a prefill chunk or one decode token)."""
    allocation = m.allocate(rid, len(history) + len(new))
    if allocation is None:
        m.check_invariants()
        return False
    sim.apply_allocation(allocation)
    start = len(history)
    history.extend(new)
    sim.write_groups(m, rid, history, start, len(history))
    m.commit_tokens(rid, history)
    m.check_invariants()
    return True


def admit(m: KVCacheManager, sim: GroupSim, rid: int, prompt: list[int]) -> list[int]:
    """Add request ``rid`` with nothing cached and prefill ``prompt`` in one step; returns its history."""
    m.add_request(rid)
    assert m.match_prefix(rid, prompt).num_cached_tokens == 0
    history: list[int] = []
    assert step(m, sim, rid, history, prompt)
    return history


def held(m: KVCacheManager, rid: int) -> list[int]:
    return [r.num_physical_blocks for r in m._maps(rid)]


def test_the_sliding_group_keeps_its_window_and_the_full_group_everything() -> None:
    m, sim = make()
    history = admit(m, sim, 1, list(range(6)))
    for t in range(30):
        assert step(m, sim, 1, history, [100 + t])
        sim.assert_groups_hold(m, 1, history)
        full, sliding = held(m, 1)
        assert full == -(-len(history) // BS)
        assert sliding <= max_resident_blocks(W, BS)
    stats = m.stats()
    assert stats.num_hole_blocks > 0 and stats.num_reclaimed_blocks_total > 0
    assert m.num_used_blocks == sum(held(m, 1))
    assert stats.group_windows == GROUPS and list(stats.group_blocks) == held(m, 1)
    assert stats.group_hole_blocks[0] == 0 and stats.group_hole_blocks[1] == stats.num_hole_blocks
    m.free(1)
    m.check_invariants()
    assert m.num_used_blocks == 0


def test_an_allocation_backs_every_group_or_none() -> None:
    m, sim = make(num_blocks=6)  # 5 usable: 2 + 2 for 8 tokens, then 3 + 3 does not fit
    history = admit(m, sim, 1, list(range(8)))
    assert m.blocks_needed(1, 9) == 2  # one more block in each group; the sliding group gives none back yet
    assert not step(m, sim, 1, history, [50])
    assert held(m, 1) == [2, 2] and m.num_free_blocks == 1  # nothing half-allocated


def test_blocks_needed_nets_what_the_sliding_group_gives_back() -> None:
    m, sim = make()
    history = admit(m, sim, 1, list(range(16)))
    # a query at 16 reads [9, 16]: the sliding group's blocks 0 and 1 (positions 0-7) leave as each group
    # takes a fifth block, and they serve either group (one pool)
    assert m.blocks_needed(1, 17) == 2 - 2
    available = m.num_available_blocks
    assert step(m, sim, 1, history, [7])
    assert m.num_available_blocks == available and held(m, 1) == [5, 3]


def test_swap_moves_every_groups_live_blocks_and_brings_holes_back() -> None:
    m, sim = make()
    history = admit(m, sim, 1, list(range(20)))
    assert step(m, sim, 1, history, [5])
    before = held(m, 1)
    plan = m.swap_out(1)
    assert plan is not None and len(plan.src_blocks) == sum(before)
    sim.apply_swap(plan)
    m.check_invariants()
    assert m.num_used_blocks == 0 and m.num_swapped_blocks == sum(before)
    plan = m.swap_in(1)
    assert plan is not None
    sim.apply_swap(plan)
    m.check_invariants()
    assert held(m, 1) == before
    sim.assert_groups_hold(m, 1, history)
    assert step(m, sim, 1, history, [6])
    sim.assert_groups_hold(m, 1, history)


def test_recompute_then_a_prefix_hit_in_every_group() -> None:
    m, sim = make()
    prompt = list(range(12))
    history = admit(m, sim, 1, prompt)
    m.preempt_recompute(1)
    m.check_invariants()
    assert held(m, 1) == [0, 0] and m.num_retained_blocks == 6  # 3 full blocks of each group retained
    hit = m.match_prefix(1, history + [99])
    assert hit.num_cached_tokens == 12 and hit.num_shared_blocks == 3
    resumed = list(history)
    assert step(m, sim, 1, resumed, [99])  # position 12 only; the rest came from the hit
    sim.assert_groups_hold(m, 1, resumed)


def evict_sliding(m: KVCacheManager, prompt: list[int], indices) -> None:
    """Evict the sliding group's retained blocks ``indices`` of ``prompt``'s chain, as the LRU would."""
    attached = m._groups[1].prefix
    serials = m._groups[0].prefix.match(prompt + [1]).serials
    for i in indices:
        block_id = attached.block_for(serials[i])
        assert block_id is not None and m._pool.is_retained(block_id)
        attached.forget_block(block_id)
        m._pool.discard_retained(block_id)
    m.check_invariants()


def test_a_sliding_group_needs_only_the_window_before_the_hit_point() -> None:
    m, sim = make()
    prompt = list(range(24))  # 6 blocks; a query at 24 reads 17..24: blocks 4 and 5 in the sliding group
    admit(m, sim, 1, prompt)
    m.free(1)
    evict_sliding(m, prompt, range(4))  # the oldest blocks: what the LRU takes first
    m.add_request(2)
    hit = m.match_prefix(2, prompt + [1])
    assert hit.num_cached_tokens == 24 and hit.num_shared_blocks == 6
    assert held(m, 2) == [6, 2] and m._maps(2)[1].num_holes == 4
    m.check_invariants()
    resumed = list(prompt)
    assert step(m, sim, 2, resumed, [1])
    sim.assert_groups_hold(m, 2, resumed)


def test_a_hit_stops_where_a_group_lacks_a_block_of_its_window() -> None:
    m, sim = make()
    prompt = list(range(24))
    admit(m, sim, 1, prompt)
    m.free(1)
    evict_sliding(m, prompt, [5])  # the last block: a hit at 20 reads 13..20, blocks 3 and 4, still there
    m.add_request(2)
    hit = m.match_prefix(2, prompt + [1])
    assert hit.num_cached_tokens == 20 and held(m, 2) == [5, 2]
    m.check_invariants()
    resumed = prompt[:20]
    assert step(m, sim, 2, resumed, prompt[20:] + [1])
    sim.assert_groups_hold(m, 2, resumed)


def test_a_copy_on_write_run_needs_every_groups_source() -> None:
    m, sim = make()
    prompt = list(range(10))  # 2 full blocks and a partial one (positions 8, 9)
    history = admit(m, sim, 1, prompt)
    assert step(m, sim, 1, history, [50, 51])  # the third block fills: registered with 8, 9, 50, 51
    m.free(1)
    m.add_request(2)
    hit = m.match_prefix(2, prompt + [60, 61])  # shares 8, 9 of the third block: a copy in each group
    assert hit.num_cached_tokens == 10 and hit.num_shared_blocks == 2 and hit.num_copy_tokens == 2
    allocation = m.allocate(2, 12)
    assert allocation is not None and len(allocation.copies) == 2  # one copy per group
    sim.apply_allocation(allocation)
    resumed = list(prompt)
    resumed.extend([60, 61])
    sim.write_groups(m, 2, resumed, 10, 12)
    m.commit_tokens(2, resumed)
    m.check_invariants()
    sim.assert_groups_hold(m, 2, resumed)
    m, sim = make()
    history = admit(m, sim, 1, list(prompt))
    assert step(m, sim, 1, history, [50, 51])
    m.free(1)
    evict_sliding(m, prompt + [50, 51], [2])  # the sliding group's source of the run goes: whole blocks only
    m.add_request(2)
    hit = m.match_prefix(2, prompt + [60, 61])
    assert hit.num_cached_tokens == 8 and hit.num_copy_tokens == 0


def test_evicting_an_anchor_entry_frees_what_other_groups_attached_to_it() -> None:
    m, sim = make()
    prompt = list(range(12))
    admit(m, sim, 1, prompt)
    m.free(1)
    assert m.num_retained_blocks == 6 and m._groups[1].prefix.num_entries == 3
    m.add_request(2)
    assert m.allocate(2, 4 * 39) is None  # 39 usable blocks; 2 x 20 do not fit, and nothing was evicted
    assert m.num_retained_blocks == 6
    assert m.allocate(2, 4 * 17) is not None  # 2 x 17 = 34 blocks: 33 free, then evictions (and cascades)
    m.check_invariants()
    assert m._groups[1].prefix.num_entries <= m._groups[0].prefix.num_entries


def _decode_past_the_window_and_free(m: KVCacheManager, sim: GroupSim) -> list[int]:
    """Request 1: a 6-token prompt decoded to 14 tokens (the sliding group gives blocks 0 and 1 back as
    they leave the window, registered), then freed: 3 full blocks retained in each group."""
    history = admit(m, sim, 1, list(range(6)))
    for t in range(8):
        assert step(m, sim, 1, history, [100 + t])
    assert m.request_memory(1).num_blocks < 2 * 4 and m.stats().num_reclaimed_blocks_total > 0
    m.free(1)
    m.check_invariants()
    assert m.num_retained_blocks == 2 * 3
    return history


def test_a_hit_ending_mid_block_copies_on_write_in_every_group() -> None:
    m, sim = make()
    first = _decode_past_the_window_and_free(m, sim)
    prompt = first[:10] + [7, 8, 9]  # two full blocks, then two of block 2's four tokens
    m.add_request(2)
    hit = m.match_prefix(2, prompt)
    assert (hit.num_cached_tokens, hit.num_shared_blocks, hit.num_copy_tokens) == (10, 2, 2)
    sources = [req.cow_src for req in m._maps(2)]
    assert None not in sources and len(set(sources)) == 2  # each group's own retained block 2, pinned
    assert all(m._pool.refcount(b) == 1 and not m._pool.is_retained(b) for b in sources)
    m.check_invariants()
    history = prompt[:10]
    allocation = m.allocate(2, len(prompt))
    assert allocation is not None
    assert sorted(c.src for c in allocation.copies) == sorted(sources)
    assert all(c.num_tokens == 2 for c in allocation.copies)
    by_src = {c.src: c.dst for c in allocation.copies}
    assert [req.blocks[2] for req in m._maps(2)] == [by_src[src] for src in sources]  # in that group's block 2
    assert all(m._pool.is_retained(b) for b in sources)  # the sources went back to the retained blocks
    sim.apply_allocation(allocation)
    history.extend(prompt[10:])
    sim.write_groups(m, 2, history, 10, len(history))
    m.commit_tokens(2, history)
    m.check_invariants()
    sim.assert_groups_hold(m, 2, history)  # positions 8, 9 came by copy, in both groups
    for t in range(6):
        assert step(m, sim, 2, history, [200 + t])
        sim.assert_groups_hold(m, 2, history)


def test_truncate_gives_back_rejected_positions_in_every_group() -> None:
    m, sim = make()
    history = admit(m, sim, 1, list(range(7)))
    draft = [1, 2, 3, 4, 5]  # positions 7..11: a third block in each group
    assert m.allocate(1, len(history) + len(draft)) is not None
    assert held(m, 1) == [3, 3]
    assert m.truncate(1, 9) == 0  # positions < 9 still need block 2 in each group
    assert m.truncate(1, 8) == 2 and held(m, 1) == [2, 2]
    m.check_invariants()


def test_three_groups_two_windows() -> None:
    m, sim = make(groups=(None, 4, 8))
    history = admit(m, sim, 1, list(range(5)))
    for t in range(20):
        assert step(m, sim, 1, history, [t])
        sim.assert_groups_hold(m, 1, history)
    full, small, large = held(m, 1)
    assert small <= max_resident_blocks(4, BS) and large <= max_resident_blocks(8, BS) and full == -(-25 // BS)


def test_groups_and_reclaim_window_are_exclusive() -> None:
    with pytest.raises(ValueError, match="not both"):
        KVCacheManager(num_blocks=4, block_size=BS, reclaim_window=W, groups=(None, W))
    with pytest.raises(ValueError, match="groups=.* is invalid"):
        KVCacheManager(num_blocks=4, block_size=BS, groups=())


def test_every_group_holds_a_request_at_the_same_block_table_row() -> None:
    """The step gathers every group's table with one row per request: a group whose free rows moved out of
    lockstep (here: a row taken behind the manager's back) must not map a request to another row silently."""
    m, sim = make()
    admit(m, sim, 1, list(range(2 * BS)))
    m._groups[1].table.add_row()  # group 1's next free row is no longer group 0's
    with pytest.raises(ValueError, match="row 1 is already in use"):
        m.add_request(2)
    m2, sim2 = make()
    for rid in (1, 2, 3):
        admit(m2, sim2, rid, list(range(rid, rid + BS + 1)))
    m2.free(2)
    admit(m2, sim2, 4, list(range(7, 7 + 2 * BS)))  # reuses the freed row in every group
    rows = {g: {rid: m2._groups[g].requests[rid].row for rid in (1, 3, 4)} for g in range(m2.num_groups)}
    assert all(r == rows[0] for r in rows.values()), rows
