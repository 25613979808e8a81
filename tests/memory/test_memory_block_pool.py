"""BlockPool on a tiny pool (11 blocks: scratch + 10): exact ids, LIFO reuse, LRU eviction order."""

from __future__ import annotations

import pytest

from tgi_paged_backend.memory.block_pool import BlockPool


def make_pool(evicted: list[int] | None = None) -> BlockPool:
    return BlockPool(11, on_evict=None if evicted is None else evicted.append)


def test_fresh_pool_hands_out_ascending_ids_and_never_the_scratch_block() -> None:
    pool = make_pool()
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(7) == [4, 5, 6, 7, 8, 9, 10]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 10
    pool.check_invariants()


def test_allocate_is_all_or_nothing() -> None:
    pool = make_pool()
    pool.allocate(8)
    assert pool.allocate(3) is None
    # Nothing was taken by the failed call.
    assert pool.num_free_blocks == 2 and pool.allocate(2) == [9, 10]
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_released_blocks_are_reused_last_released_first() -> None:
    pool = make_pool()
    pool.allocate(4)  # 1..4
    pool.decref(2, retain=False)
    pool.decref(3, retain=False)
    # 3 was released last, so it comes back first; then 2; then the untouched 5.
    assert pool.allocate(3) == [3, 2, 5]
    pool.check_invariants()


def test_retained_blocks_are_evicted_oldest_released_first_after_free_ones() -> None:
    evicted: list[int] = []
    pool = make_pool(evicted)
    pool.allocate(10)
    for block_id in (4, 2, 7):
        pool.decref(block_id, retain=True)
    pool.decref(9, retain=False)
    assert pool.retained_lru() == [4, 2, 7] and pool.free_list() == [9]
    # The free block goes first, then retained blocks in release order.
    assert pool.allocate(3) == [9, 4, 2]
    assert evicted == [4, 2]
    assert pool.retained_lru() == [7]
    pool.check_invariants()


def test_sharing_a_retained_block_takes_it_out_of_the_lru_queue() -> None:
    pool = make_pool()
    pool.allocate(10)
    for block_id in (4, 2, 7):
        pool.decref(block_id, retain=True)
    pool.incref(2)  # reused by a prefix hit
    assert pool.retained_lru() == [4, 7] and pool.refcount(2) == 1
    pool.incref(2)  # and by a second request
    pool.decref(2, retain=True)
    assert pool.retained_lru() == [4, 7]  # still held once
    pool.decref(2, retain=True)
    assert pool.retained_lru() == [4, 7, 2]  # most recently released, evicted last
    pool.check_invariants()


def test_allocation_fails_only_when_free_plus_retained_is_short() -> None:
    evicted: list[int] = []
    pool = make_pool(evicted)
    pool.allocate(10)
    pool.decref(5, retain=True)
    assert pool.allocate(2) is None and evicted == []  # no eviction when it cannot succeed
    assert pool.allocate(1) == [5] and evicted == [5]


def test_evict_all_retained_reports_each_block() -> None:
    evicted: list[int] = []
    pool = make_pool(evicted)
    pool.allocate(3)
    for block_id in (3, 1, 2):
        pool.decref(block_id, retain=True)
    assert pool.evict_all_retained() == 3
    assert evicted == [3, 1, 2] and pool.num_free_blocks == 10
    pool.check_invariants()


def test_check_invariants_detects_a_duplicated_free_block() -> None:
    pool = make_pool()
    pool.allocate(2)
    pool._free.append(1)  # corrupt: block 1 is used and free at once
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_releasing_more_often_than_held_is_a_bug() -> None:
    pool = make_pool()
    [block_id] = pool.allocate(1)
    pool.decref(block_id, retain=False)
    with pytest.raises(AssertionError):
        pool.decref(block_id, retain=False)


def test_pool_needs_a_usable_block_besides_scratch() -> None:
    with pytest.raises(ValueError, match="num_blocks=1"):
        BlockPool(1)
