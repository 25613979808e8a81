"""KVCacheManager on a tiny pool (11 blocks x 16 tokens): exact ids, plans, slots and waste."""

from __future__ import annotations

import numpy as np
import pytest
from memory_sim import KVSim

from tgi_paged_backend.memory import Allocation, BlockCopy, KVCacheManager, PrefixMatch, SwapPlan

BS = 16
U64_MAX = 2**64 - 1


def make_manager(num_swap_blocks: int = 4, retention: bool = True) -> KVCacheManager:
    return KVCacheManager(
        num_blocks=11, block_size=BS, num_swap_blocks=num_swap_blocks, enable_prefix_retention=retention
    )


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def run_prompt(
    m: KVCacheManager, request_id: int, prompt: list[int], virtual_blocks: tuple[int, ...] = ()
) -> tuple[PrefixMatch, Allocation]:
    m.add_request(request_id, virtual_blocks)
    match = m.match_prefix(request_id, prompt)
    allocation = m.allocate(request_id, len(prompt))
    assert allocation is not None
    m.commit_tokens(request_id, prompt)
    m.check_invariants()
    return match, allocation


def test_physical_blocks_are_mapped_lazily_under_a_worst_case_reservation() -> None:
    m = make_manager()
    # The router reserved 8 blocks (prompt 20 + max_new_tokens 100); only 2 are backed.
    virtual = (30, 31, 32, 33, 34, 35, 36, 37)
    _, allocation = run_prompt(m, 7, tokens(20), virtual)
    assert allocation == Allocation((1, 2), ())
    assert m.num_used_blocks == 2 and m.num_free_blocks == 8
    # Decode: positions 20..31 fit in block 2; position 32 needs a third block.
    assert m.blocks_needed(7, 32) == 0 and m.blocks_needed(7, 33) == 1
    assert m.allocate(7, 32) == Allocation()
    assert m.allocate(7, 33) == Allocation((3,), ())
    m.check_invariants()


def test_block_tables_and_slot_mappings() -> None:
    m = make_manager()
    run_prompt(m, 1, tokens(20))  # blocks 1, 2
    run_prompt(m, 2, tokens(5, 100))  # block 3
    np.testing.assert_array_equal(m.block_tables([2, 1]), [[3, 0], [1, 2]])
    assert m.block_tables([1]).dtype == np.int32
    slots = m.slot_mapping([1, 2], [14, 0], [4, 2])
    assert slots.dtype == np.int64
    np.testing.assert_array_equal(slots, [1 * BS + 14, 1 * BS + 15, 2 * BS + 0, 2 * BS + 1, 3 * BS, 3 * BS + 1])
    np.testing.assert_array_equal(m.decode_slot_mapping([1, 2], [19, 4]), [2 * BS + 3, 3 * BS + 4])
    with pytest.raises(ValueError, match="without a physical block"):
        m.decode_slot_mapping([2], [16])


def test_router_slots_translate_to_physical_slots() -> None:
    m = make_manager()
    run_prompt(m, 1, tokens(20), (9, 4, 6))
    router = np.array([9 * BS + 0, 9 * BS + 15, 4 * BS + 3, 0])
    np.testing.assert_array_equal(m.virtual_to_physical_slots(1, router), [BS + 0, BS + 15, 2 * BS + 3, 0])
    with pytest.raises(ValueError, match="not backed"):
        m.virtual_to_physical_slots(1, np.array([6 * BS]))
    with pytest.raises(ValueError, match="outside"):
        m.virtual_to_physical_slots(1, np.array([5 * BS]))
    with pytest.raises(ValueError, match="exceed"):
        m.allocate(1, 3 * BS + 1)


def test_liveness_probe_uses_the_scratch_block_and_no_pool_memory() -> None:
    m = make_manager()
    run_prompt(m, U64_MAX, [42], (0,))
    assert m.num_used_blocks == 0
    np.testing.assert_array_equal(m.block_tables([U64_MAX]), [[0]])
    np.testing.assert_array_equal(m.slot_mapping([U64_MAX], [0], [1]), [0])
    np.testing.assert_array_equal(m.virtual_to_physical_slots(U64_MAX, np.array([0])), [0])
    m.free(U64_MAX)
    m.check_invariants()
    assert m.num_free_blocks == 10


def test_finished_prompt_is_shared_by_the_next_request() -> None:
    m = make_manager()
    prompt = tokens(40)
    run_prompt(m, 1, prompt)  # blocks 1, 2, 3 (3 is partial: 8 tokens)
    m.free(1)
    assert m.num_retained_blocks == 2 and m.num_free_blocks == 8  # only full blocks are kept
    match, allocation = run_prompt(m, 2, prompt + [7])
    assert match == PrefixMatch(32, 2, None, 0)
    assert allocation == Allocation((3,), ())
    np.testing.assert_array_equal(m.block_tables([2]), [[1, 2, 3]])
    assert m.stats().num_prefix_hit_tokens == 32


def test_shared_blocks_are_refcounted_across_live_requests() -> None:
    m = make_manager()
    run_prompt(m, 1, tokens(33))
    m.free(1)
    run_prompt(m, 2, tokens(33))
    run_prompt(m, 3, tokens(33))
    np.testing.assert_array_equal(m.block_tables([2, 3]), [[1, 2, 3], [1, 2, 4]])
    assert m.num_used_blocks == 4
    assert m.request_memory(2).num_exclusive_blocks == 1
    m.free(2)
    assert m.num_used_blocks == 3  # blocks 1, 2 still held by request 3
    m.check_invariants()


def test_fully_cached_prompt_copies_its_last_block_so_one_token_is_computed() -> None:
    m = make_manager()
    sim = KVSim(11, BS)
    prompt = tokens(32)
    run_prompt(m, 1, prompt)
    sim.write(m, 1, prompt, 0, 32)
    m.free(1)
    match, allocation = run_prompt(m, 2, prompt)
    # Block 1 is shared; block 2 is copied (15 valid tokens) into a fresh block 3.
    assert match == PrefixMatch(31, 1, 2, 15)
    assert allocation == Allocation((3,), (BlockCopy(2, 3, 15),))
    sim.apply_allocation(allocation)
    sim.write(m, 2, prompt, 31, 32)
    sim.assert_holds(m, 2, prompt, 32)


def test_diverging_prompt_copies_the_matching_part_of_a_block() -> None:
    m = make_manager()
    sim = KVSim(11, BS)
    first = tokens(32)
    run_prompt(m, 1, first)
    sim.write(m, 1, first, 0, 32)
    m.free(1)
    second = first[:21] + [999] * 10  # shares block 0 and 5 tokens of block 1
    match, allocation = run_prompt(m, 2, second)
    assert match == PrefixMatch(21, 1, 2, 5)
    assert allocation == Allocation((3,), (BlockCopy(2, 3, 5),))
    sim.apply_allocation(allocation)
    sim.write(m, 2, second, 21, 31)
    sim.assert_holds(m, 2, second, 31)
    # The copy source was only pinned until the copy was issued: it is retained again.
    assert m.num_retained_blocks == 1


def test_retained_blocks_are_reclaimed_tail_first_before_allocation_fails() -> None:
    m = make_manager()
    run_prompt(m, 1, tokens(48))  # blocks 1, 2, 3, all full
    m.free(1)
    assert m._pool.retained_lru() == [3, 2, 1]  # a chain's tail is evicted before its head
    run_prompt(m, 2, tokens(8 * BS, 1000))  # takes the 7 free blocks, then evicts block 3
    np.testing.assert_array_equal(m.block_tables([2]), [[4, 5, 6, 7, 8, 9, 10, 3]])
    m.free(2)
    assert m._pool.retained_lru() == [2, 1, 3, 10, 9, 8, 7, 6, 5, 4]
    match, allocation = run_prompt(m, 3, tokens(33))  # blocks 1 and 2 still match
    assert match.num_cached_tokens == 32
    assert allocation == Allocation((3,), ())  # evicted: the oldest retained block not in use
    m.add_request(4)
    assert m.allocate(4, 8 * BS) is None  # 7 retained blocks are not enough: all or nothing
    assert m.num_retained_blocks == 7
    m.check_invariants()


def test_recompute_preemption_loses_tokens_but_keeps_them_retained() -> None:
    m = make_manager()
    history = tokens(40)
    run_prompt(m, 1, history)
    assert m.preempt_recompute(1) == 40
    assert m.num_used_blocks == 0 and m.num_retained_blocks == 2
    np.testing.assert_array_equal(m.block_tables([1]), [[0]])
    # Resume: the retained blocks come back, 8 tokens are recomputed.
    match = m.match_prefix(1, history)
    assert match == PrefixMatch(32, 2, None, 0)
    assert m.allocate(1, 40) == Allocation((3,), ())
    m.check_invariants()


def test_swap_out_and_in_plans() -> None:
    m = make_manager(num_swap_blocks=4)
    sim = KVSim(11, BS, 4)
    history = tokens(40)
    run_prompt(m, 1, history)
    sim.write(m, 1, history, 0, 40)
    plan = m.swap_out(1)
    assert plan == SwapPlan(1, "out", (1, 2, 3), (0, 1, 2))
    sim.apply_swap(plan)
    assert m.num_swapped_blocks == 3 and m.num_used_blocks == 0
    run_prompt(m, 2, tokens(10, 500))  # reuses block 1 (released last: blocks go back tail first)
    plan = m.swap_in(1)
    assert plan == SwapPlan(1, "in", (0, 1, 2), (2, 3, 4))
    sim.apply_swap(plan)
    sim.assert_holds(m, 1, history, 40)
    assert m.num_swapped_blocks == 0
    m.check_invariants()


def test_swap_needs_room_on_both_sides() -> None:
    m = make_manager(num_swap_blocks=2)
    run_prompt(m, 1, tokens(40))  # 3 blocks > 2 swap blocks
    assert not m.can_swap_out(1) and m.swap_out(1) is None
    run_prompt(m, 2, tokens(20, 100))  # 2 blocks
    assert m.swap_out(2) is not None
    run_prompt(m, 3, tokens(7 * BS, 200))  # fills the pool
    assert m.swap_in(2) is None
    m.free(3)
    assert m.swap_in(2) is not None
    disabled = make_manager(num_swap_blocks=0)
    run_prompt(disabled, 1, tokens(3))
    assert disabled.swap_out(1) is None


def test_waste_accounting() -> None:
    m = make_manager()
    run_prompt(m, 1, tokens(20), (30, 31, 32, 33))  # 2 of 4 reserved blocks backed, 12 slots unfilled
    run_prompt(m, 2, tokens(16))  # self-managed, exactly one full block
    stats = m.stats(num_pending_blocks=8)
    assert (stats.num_used_blocks, stats.num_free_blocks) == (3, 7)
    assert stats.internal_waste_slots == 12
    assert stats.reservation_waste_slots == 2 * BS and stats.num_reserved_slots == 4 * BS
    assert stats.external_waste_blocks == 7  # 7 free blocks cannot serve a pending need of 8
    assert stats.internal_waste_ratio == pytest.approx(12 / (3 * BS))
    assert stats.reservation_waste_ratio == pytest.approx(0.5)
    assert m.stats(num_pending_blocks=7).external_waste_blocks == 0


def test_retention_can_be_switched_off() -> None:
    m = make_manager(retention=False)
    run_prompt(m, 1, tokens(40))
    m.free(1)
    assert m.num_retained_blocks == 0 and m.num_free_blocks == 10
    match, _ = run_prompt(m, 2, tokens(40))
    assert match.num_cached_tokens == 0


def test_check_invariants_catches_a_refcount_that_disagrees_with_the_holders() -> None:
    m = make_manager()
    run_prompt(m, 1, tokens(20))
    m._pool.incref(1)  # corrupt: a holder nobody accounts for
    with pytest.raises(AssertionError, match="refcount"):
        m.check_invariants()


def test_duplicate_request_ids_are_rejected() -> None:
    m = make_manager()
    m.add_request(0)
    with pytest.raises(ValueError, match="already registered"):
        m.add_request(0)


def test_block_tables_follow_rows_recycled_between_identical_batches() -> None:
    m = make_manager()
    run_prompt(m, 1, tokens(5))  # block 1
    run_prompt(m, 2, tokens(5, 100))  # block 2
    np.testing.assert_array_equal(m.block_tables([1, 2]), [[1], [2]])
    m.free(2)
    m.free(1)
    run_prompt(m, 2, tokens(20, 300))  # takes request 1's old row
    run_prompt(m, 1, tokens(5, 200))
    np.testing.assert_array_equal(m.block_tables([1, 2]), [[3, 0], [1, 2]])
    np.testing.assert_array_equal(m.decode_slot_mapping([1, 2], [4, 17]), [3 * BS + 4, 2 * BS + 1])


def test_waste_counts_positions_being_written_even_before_commit() -> None:
    m = make_manager()
    run_prompt(m, 1, tokens(20))
    assert m.allocate(1, 21) == Allocation()  # decode step in flight: position 20 is being written
    stats = m.stats()
    assert stats.num_written_tokens == 21 and stats.internal_waste_slots == 11
