"""Sliding-window block reclaim (block size 4, window 8): positions, holes, and how holes meet
prefix retention, copy-on-write, swap, recompute, block tables and the waste books."""

from __future__ import annotations

import numpy as np
import pytest
from memory_sim import KVSim

from tgi_paged_backend.memory import SCRATCH_BLOCK, KVCacheManager
from tgi_paged_backend.memory.window_reclaim import (
    first_visible_position,
    hybrid_pool_saving,
    max_resident_blocks,
    num_blocks_outside_window,
    reclaim_window,
)

BS = 4
W = 8


def make(
    num_blocks: int = 11, num_swap_blocks: int = 4, window: int | None = W, retention: bool = True
) -> tuple[KVCacheManager, KVSim]:
    m = KVCacheManager(
        num_blocks=num_blocks,
        block_size=BS,
        num_swap_blocks=num_swap_blocks,
        enable_prefix_retention=retention,
        reclaim_window=window,
    )
    return m, KVSim(num_blocks, BS, num_swap_blocks)


def prefill(m: KVCacheManager, sim: KVSim, rid: int, history: list[int], virtual: tuple[int, ...] = ()) -> int:
    """Admit, match and write the whole prompt in one chunk; returns the cached tokens."""
    m.add_request(rid, virtual)
    cached = m.match_prefix(rid, history).num_cached_tokens
    allocation = m.allocate(rid, len(history))
    assert allocation is not None
    sim.apply_allocation(allocation)
    sim.write(m, rid, history, cached, len(history))
    m.commit_tokens(rid, history)
    return cached


def decode(m: KVCacheManager, sim: KVSim, rid: int, history: list[int], token: int) -> bool:
    """One decode step of ``token``; ``False`` (nothing changed but the reclaim) when the pool is dry."""
    allocation = m.allocate(rid, len(history) + 1)
    if allocation is None:
        return False
    sim.apply_allocation(allocation)
    history.append(token)
    sim.write(m, rid, history, len(history) - 1, len(history))
    m.commit_tokens(rid, history)
    return True


def window_start(n: int) -> int:
    """First position the query at ``n - 1`` (the latest written) reads."""
    return first_visible_position(n - 1, W)


# ------------------------------------------------------------------------------------ arithmetic
def test_window_arithmetic() -> None:
    # A query at p reads keys p - W + 1 .. p: at 11 that is 4..11, so block 0 (0..3) is outside.
    assert [num_blocks_outside_window(p, W, BS) for p in (0, 7, 10, 11, 14, 15, 100)] == [0, 0, 0, 1, 1, 2, 23]
    assert first_visible_position(3, W) == 0 and first_visible_position(20, W) == 13
    assert max_resident_blocks(W, BS) == 3  # 8 positions straddle at most 3 blocks of 4
    assert max_resident_blocks(W, BS, num_new_tokens=9) == 5  # a 9-token chunk reads 16 positions
    assert max_resident_blocks(4096, 16) == 257


def test_reclaim_window_only_when_every_layer_is_windowed() -> None:
    assert reclaim_window(4096, None) == 4096  # Mistral v0.1: every layer uses config.sliding_window
    assert reclaim_window(4096, [4096, 4096]) == 4096
    assert reclaim_window(4096, [4096, None]) is None  # Gemma 2: alternating sliding / full layers
    assert reclaim_window(None, None) is None and reclaim_window(4096, []) is None


def test_hybrid_pool_saving_is_the_windowed_layers_share_beyond_the_window() -> None:
    # Gemma 2 style, half the layers windowed: at 8 * W tokens the windowed half keeps ~1/8 of it.
    saving = hybrid_pool_saving([4096, None] * 21, 32768, 16)
    assert saving == pytest.approx(0.5 * (1 - 257 / 2048))
    assert hybrid_pool_saving([4096, None], 1000, 16) == 0.0  # shorter than the window: nothing
    assert hybrid_pool_saving([None, None], 32768, 16) == 0.0


# ------------------------------------------------------------------------------------- decoding
def test_decoding_past_the_window_keeps_at_most_three_blocks_and_holes_map_to_scratch() -> None:
    m, sim = make(num_blocks=5, retention=False)  # 4 usable blocks: 16 tokens without reclaim
    history = list(range(6))
    prefill(m, sim, 1, history)
    peak = 0
    while len(history) < 100:
        assert decode(m, sim, 1, history, len(history) % 7)
        m.check_invariants()
        peak = max(peak, m.request_memory(1).num_blocks)
        sim.assert_holds(m, 1, history, len(history), start=window_start(len(history)))
    assert peak == max_resident_blocks(W, BS)
    # The query at 99 reads 92..99: blocks 0..22 are holes, 23 and 24 are mapped.
    table = m.block_tables([1])[0]
    assert (table[:23] == SCRATCH_BLOCK).all() and (table[23:25] != SCRATCH_BLOCK).all()
    stats = m.stats()
    assert stats.num_hole_blocks == 23 and stats.num_reclaimed_blocks_total == 23
    assert stats.num_used_blocks == 2 and stats.num_free_blocks == 2
    assert stats.num_written_tokens == 100 - 23 * BS and stats.internal_waste_slots == 0
    m.free(1)
    assert m.num_free_blocks == 4
    m.check_invariants()


def test_blocks_leaving_the_window_are_retained_and_the_chain_goes_on_past_the_holes() -> None:
    m, sim = make(num_blocks=13)
    prompt = list(range(30))
    m.add_request(1)
    m.match_prefix(1, prompt)
    for end in (8, 16, 24, 30):  # chunked prefill: each chunk's first query lets earlier blocks go
        assert m.allocate(1, end) is not None
        sim.write(m, 1, prompt, end - 8 if end != 30 else 24, end)
        m.commit_tokens(1, prompt[:end])
    history = list(prompt)
    while len(history) < 40:
        assert decode(m, sim, 1, history, 7)
    assert m.stats().num_hole_blocks == 8 and m.num_retained_blocks == 8  # registered as they left
    m.check_invariants()
    m.free(1)  # the rest of the chain, from where it ended: every full committed block
    assert m.num_retained_blocks == 10 and m.num_free_blocks == 2
    # A follow-up with the same history (plus a turn) matches all of it, chain verified from the root.
    follow_up = history + [1, 2, 3]
    assert prefill(m, sim, 2, follow_up) == 40
    sim.assert_holds(m, 2, follow_up, len(follow_up), start=window_start(len(follow_up)))
    assert m.stats().num_hole_blocks == num_blocks_outside_window(40, W, BS)
    m.check_invariants()


def test_an_evicted_chain_head_leaves_nothing_matchable_and_nothing_leaked() -> None:
    m, sim = make(num_blocks=5)  # 4 usable: retained blocks are evicted as decoding goes on
    history = list(range(6))
    prefill(m, sim, 1, history)
    while len(history) < 40:
        assert decode(m, sim, 1, history, 3)
        m.check_invariants()
    assert m.num_retained_blocks == 2 and m.num_used_blocks == 2  # the head went first (LRU)
    m.free(1)  # the tail is registered under a chain whose head is gone: unreachable, reclaimable
    m.check_invariants()
    assert m.num_free_blocks + m.num_retained_blocks == 4 and m.num_used_blocks == 0
    m.add_request(2)
    assert m.match_prefix(2, history + [1]).num_cached_tokens == 0
    m.reset_prefix_cache()
    assert m.num_free_blocks == 4


def test_without_a_window_the_same_run_runs_dry() -> None:
    m, sim = make(num_blocks=5, window=None)
    history = list(range(6))
    prefill(m, sim, 1, history)
    while decode(m, sim, 1, history, 1):
        pass
    assert len(history) == 16 and m.stats().num_reclaimed_blocks_total == 0


def test_a_long_chunk_keeps_every_block_its_first_query_reads() -> None:
    m, sim = make()
    history = list(range(20))
    prefill(m, sim, 1, history)  # queries 0..19 in one step: nothing may be reclaimed before it
    assert m.request_memory(1).num_blocks == 5 and m.stats().num_hole_blocks == 0
    sim.assert_holds(m, 1, history, 20)
    assert decode(m, sim, 1, history, 3)  # the query at 20 reads 13..20: blocks 0..2 go
    assert m.stats().num_hole_blocks == 3 and m.request_memory(1).num_blocks == 3
    m.check_invariants()


def test_chunked_prefill_reclaims_chunk_by_chunk() -> None:
    m, sim = make(num_blocks=6)  # 5 usable blocks, prompt of 40 tokens = 10 blocks
    prompt = list(range(40))
    m.add_request(1)
    assert m.match_prefix(1, prompt).num_cached_tokens == 0
    for end in range(8, 41, 8):  # chunks of 8 tokens: each reads 15 positions, at most 5 blocks
        allocation = m.allocate(1, end)
        assert allocation is not None, end
        sim.write(m, 1, prompt, end - 8, end)
        m.commit_tokens(1, prompt[:end])
        assert m.request_memory(1).num_blocks <= max_resident_blocks(W, BS, 8)
        m.check_invariants()
    sim.assert_holds(m, 1, prompt, 40, start=window_start(40))
    assert m.stats().num_hole_blocks == num_blocks_outside_window(32, W, BS) == 6


def test_blocks_needed_is_the_net_draw_and_a_failed_allocation_still_reclaims() -> None:
    m, sim = make(num_blocks=5)  # 4 usable blocks
    history = list(range(12))
    prefill(m, sim, 1, history)  # blocks 1, 2, 3 (positions 0..11)
    prefill(m, sim, 2, [9])  # block 4: the pool is full
    assert m.num_available_blocks == 0
    # A chunk 12..19 needs 2 fresh blocks; its first query (12) reads 5..: block 0 goes back first.
    assert m.blocks_needed(1, 20) == 1
    assert m.allocate(1, 20) is None  # 1 short: all or nothing ...
    assert m.stats().num_hole_blocks == 1 and m.num_available_blocks == 1  # ... but the reclaim stays
    m.check_invariants()
    assert m.blocks_needed(1, 13) == 1 and m.blocks_needed(1, 12) == 0
    allocation = m.allocate(1, 13)  # one decode step fits, in the block just given back
    assert allocation is not None and allocation.new_blocks == (1,)
    sim.write(m, 1, history + [0], 12, 13)
    m.check_invariants()


def test_reservation_waste_leaves_holes_out() -> None:
    m, sim = make()
    virtual = tuple(range(30, 38))  # 8 router blocks = 32 positions
    history = list(range(6))
    prefill(m, sim, 1, history, virtual)
    while len(history) < 30:
        assert decode(m, sim, 1, history, 2)
    stats = m.stats()
    holes = num_blocks_outside_window(29, W, BS)
    mapped = m.request_memory(1).num_blocks
    assert stats.num_hole_blocks == holes == 5 and mapped == 3
    assert stats.reservation_waste_slots == (8 - holes - mapped) * BS
    assert stats.internal_waste_slots == mapped * BS - (30 - holes * BS)
    # Router slots of a hole translate to the scratch block; those of the window to real blocks.
    router = np.array([30 * BS, 37 * BS + 1])
    np.testing.assert_array_equal(m.virtual_to_physical_slots(1, router)[:1], [0])
    with pytest.raises(ValueError, match="exceed"):
        m.allocate(1, 33)


# --------------------------------------------------------------------------------- interplay
def test_shared_prefix_blocks_behind_the_window_go_back_to_the_retained_lru() -> None:
    m, sim = make()
    prompt = list(range(17))
    prefill(m, sim, 1, prompt)  # blocks 1..5, 4 full
    m.free(1)  # no holes yet (one chunk): the 4 full blocks are retained
    assert m.num_retained_blocks == 4
    history = list(prompt)
    # Shares 4 blocks and computes position 16, whose query reads 9..16: blocks 0, 1 leave at once.
    assert prefill(m, sim, 2, history) == 16
    assert m.stats().num_hole_blocks == 2 and m.num_retained_blocks == 2  # registered: retained
    assert prefill(m, sim, 3, list(prompt)) == 16  # matches the retained chain again, same holes
    assert m.num_retained_blocks == 2 and m.request_memory(3).num_exclusive_blocks == 1
    while len(history) < 20:  # the query at 19 reads 12..: block 2 leaves request 2, 3 still holds it
        assert decode(m, sim, 2, history, 5)
    assert m.request_memory(2).num_blocks == 2 and m.num_retained_blocks == 2
    m.free(3)  # holes: registers nothing new; its shared block 2 has no holder left: retained
    assert m.num_retained_blocks == 3
    sim.assert_holds(m, 2, history, len(history), start=window_start(len(history)))
    m.check_invariants()
    m.free(2)
    assert m.num_retained_blocks == 5  # the chain is whole in the LRU (with 2's decoded block 16..19)
    assert prefill(m, sim, 4, list(prompt)) == 16
    m.check_invariants()


def test_copy_on_write_with_reclaim_in_the_same_allocation() -> None:
    m, sim = make()
    prompt = list(range(16))
    prefill(m, sim, 1, prompt)
    m.free(1)  # 4 full blocks retained
    other = prompt[:14] + [77, 78]
    m.add_request(2)
    match = m.match_prefix(2, other)  # 3 shared + a copy of positions 12, 13 from block 3
    assert (match.num_shared_blocks, match.num_copy_tokens) == (3, 2) and match.copy_src is not None
    allocation = m.allocate(2, 16)  # the query at 14 reads 7..: block 0 leaves, block 3 is copied
    assert allocation is not None and len(allocation.copies) == 1
    sim.apply_allocation(allocation)
    sim.write(m, 2, other, 14, 16)
    m.commit_tokens(2, other)
    assert m.stats().num_hole_blocks == 1
    sim.assert_holds(m, 2, other, 16, start=window_start(16))
    m.check_invariants()


def test_swap_out_and_in_skip_holes_and_bring_them_back_as_holes() -> None:
    m, sim = make(num_swap_blocks=3)
    history = list(range(6))
    prefill(m, sim, 1, history)
    while len(history) < 27:
        assert decode(m, sim, 1, history, 4)
    holes = m.stats().num_hole_blocks
    assert holes == 4 and m.can_swap_out(1)
    out = m.swap_out(1)
    assert out is not None and out.num_blocks == 3  # only the window's blocks travel
    sim.apply_swap(out)
    assert m.stats().num_hole_blocks == holes and m.num_used_blocks == 0
    prefill(m, sim, 2, list(range(100, 140)))  # another request overwrites the pool meanwhile
    m.free(2)
    back = m.swap_in(1)
    assert back is not None and back.num_blocks == 3
    sim.apply_swap(back)
    table = m.block_tables([1])[0]
    assert (table[:holes] == SCRATCH_BLOCK).all() and (table[holes:7] != SCRATCH_BLOCK).all()
    m.check_invariants()
    sim.assert_holds(m, 1, history, 27, start=window_start(27))
    while len(history) < 40:
        assert decode(m, sim, 1, history, 1)
        sim.assert_holds(m, 1, history, len(history), start=window_start(len(history)))
    m.check_invariants()


def test_recompute_preemption_starts_afresh_and_rebuilds_only_the_window() -> None:
    m, sim = make(num_blocks=6, retention=False)
    history = list(range(6))
    prefill(m, sim, 1, history)
    while len(history) < 30:
        assert decode(m, sim, 1, history, 6)
    assert m.preempt_recompute(1) == 30
    assert m.num_used_blocks == 0 and m.num_free_blocks == 5 and m.stats().num_hole_blocks == 0
    m.check_invariants()
    # Resume: the history is prefilled again in chunks of 8; only the window is kept.
    assert m.match_prefix(1, history).num_cached_tokens == 0
    for end in (8, 16, 24, 30):
        assert m.allocate(1, end) is not None
        sim.write(m, 1, history, max(end - 8, 0) if end != 30 else 24, end)
        m.commit_tokens(1, history[:end])
        m.check_invariants()
    sim.assert_holds(m, 1, history, 30, start=window_start(30))
    assert m.request_memory(1).num_blocks <= max_resident_blocks(W, BS, 8)
    assert decode(m, sim, 1, history, 0)
    m.check_invariants()


def test_check_invariants_catches_a_hole_inside_the_window() -> None:
    m, sim = make()
    history = list(range(6))
    prefill(m, sim, 1, history)
    req = m._requests[1]
    m._pool.decref(req.blocks[1], retain=False)  # corrupt: a hole where the window still reads
    req.blocks[0:2] = [SCRATCH_BLOCK, SCRATCH_BLOCK]
    m._pool.decref(1, retain=False)
    m._table.unmap(req.row, 0, 2)
    req.num_holes = 2
    with pytest.raises(AssertionError, match="inside the window"):
        m.check_invariants()


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="reclaim_window"):
        KVCacheManager(num_blocks=4, block_size=BS, reclaim_window=0)
