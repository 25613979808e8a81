"""PrefixCache over a tiny pool (block size 4 for readable token lists): matches, COW, collisions."""

from __future__ import annotations

import pytest

from tgi_paged_backend.memory import prefix_cache as prefix_cache_module
from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.prefix_cache import NullPrefixCache, PrefixCache, PrefixHit

A = [1, 2, 3, 4]
B = [5, 6, 7, 8]
C = [9, 10, 11, 12]


def make_cache() -> tuple[BlockPool, PrefixCache]:
    pool = BlockPool(11)
    cache = PrefixCache(pool, 4)
    pool.on_evict = cache.forget_block
    return pool, cache


def retire(pool: BlockPool, cache: PrefixCache, token_ids: list[int], num_blocks: int) -> list[int]:
    """Allocate blocks for a finished request, register them and release them (last first)."""
    blocks = pool.allocate(num_blocks)
    assert blocks is not None
    cache.register(token_ids, blocks, len(token_ids))
    for block_id in reversed(blocks):
        pool.decref(block_id, retain=cache.is_registered(block_id))
    return blocks


def test_full_blocks_match_in_order() -> None:
    pool, cache = make_cache()
    assert retire(pool, cache, A + B + C, 3) == [1, 2, 3]
    assert pool.retained_lru() == [3, 2, 1]  # tail first: C is evicted before B before A
    # Prompt A + B + one more token: two full blocks, the last token is computed.
    assert cache.match(A + B + [99]) == PrefixHit((1, 2), None, 0)
    cache.check_invariants()


def test_the_last_prompt_token_is_never_cached() -> None:
    pool, cache = make_cache()
    retire(pool, cache, A + B, 2)
    # A + B is fully cached, but one token must be computed: share A, copy 3 tokens of B.
    assert cache.match(A + B) == PrefixHit((1,), 2, 3)
    assert cache.match(A) == PrefixHit((), 1, 3)
    assert cache.match([1]) == PrefixHit()


def test_partly_matching_block_is_offered_for_copy_on_write() -> None:
    pool, cache = make_cache()
    retire(pool, cache, A + B, 2)
    retire(pool, cache, A + [5, 6, 0, 0], 2)  # A is already cached: only the second block is new
    # After A, the child sharing the longest run with [5, 6, 7, 1] is B (3 tokens).
    assert cache.match(A + [5, 6, 7, 1, 42]) == PrefixHit((1,), 2, 3)
    assert cache.match(A + [5, 6, 0, 9, 42]) == PrefixHit((1,), 4, 3)
    assert cache.match(A + [8, 8, 8, 8, 42]) == PrefixHit((1,), None, 0)


def test_a_different_parent_never_matches_the_same_tokens() -> None:
    pool, cache = make_cache()
    retire(pool, cache, A + B, 2)
    # B's tokens after C: the chain differs, so neither block matches.
    assert cache.match(C + B + [1]) == PrefixHit()


def test_duplicate_content_is_registered_once() -> None:
    pool, cache = make_cache()
    retire(pool, cache, A + B, 2)
    blocks = pool.allocate(2)  # a second request computed A + B itself
    assert blocks == [3, 4]
    assert cache.register(A + B, blocks, 8) == 0
    assert not cache.is_registered(3) and not cache.is_registered(4)


def test_no_false_sharing_when_every_hash_collides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache_module, "chain_hash", lambda parent, tokens: 42)
    pool, cache = make_cache()
    retire(pool, cache, A + B, 2)
    # Only A got registered: B's key collides with A's entry (different parent), so the chain stops.
    assert cache.num_entries == 1
    assert cache.match(C + [1]) == PrefixHit()  # same hash as A, different tokens
    assert cache.match(A + B + [1]) == PrefixHit((1,), None, 0)
    cache.check_invariants()


def test_eviction_forgets_the_block_and_orphans_its_children() -> None:
    pool, cache = make_cache()
    retire(pool, cache, A + B, 2)  # LRU: [2 (B), 1 (A)]
    pool.incref(2)  # keep B alive while A is evicted
    assert pool.allocate(9) is not None  # 8 free blocks + evicts A
    assert not cache.is_registered(1)
    assert cache.match(A + B + [1]) == PrefixHit()  # B is unreachable without A
    cache.check_invariants()


def test_stale_entry_is_replaced_when_the_prefix_is_registered_again() -> None:
    pool, cache = make_cache()
    retire(pool, cache, A + B, 2)
    pool.incref(2)
    extra = pool.allocate(9)  # evicts A; B (block 2) is stale but in use
    assert extra is not None
    for block_id in extra:
        pool.decref(block_id, retain=False)
    pool.decref(2, retain=cache.is_registered(2))  # B goes back to retained, still stale
    assert pool.retained_lru() == [2]
    blocks = pool.allocate(2)  # a new request computes A + B again (free blocks, last released first)
    assert blocks == [1, 10]
    assert cache.register(A + B, blocks, 8) == 2
    # The stale B was dropped (block 2 freed), the new chain matches.
    assert pool.retained_lru() == [] and not cache.is_registered(2)
    assert cache.match(A + B + [1]) == PrefixHit(tuple(blocks), None, 0)
    cache.check_invariants()


def test_null_cache_never_matches_or_registers() -> None:
    pool = BlockPool(11)
    cache = NullPrefixCache(pool, 4)
    blocks = pool.allocate(2)
    assert blocks is not None
    assert cache.register(A + B, blocks, 8) == 0
    assert cache.match(A + B + [1]) == PrefixHit()
    cache.check_invariants()


def test_extend_goes_on_past_holes_from_the_cursor_and_stops_behind_an_evicted_entry() -> None:
    from tgi_paged_backend.memory.prefix_cache import CHAIN_START

    pool, cache = make_cache()
    blocks = pool.allocate(3)
    assert blocks is not None
    cursor, num_new = cache.extend(A + B, blocks, 8, CHAIN_START)  # blocks 1, 2 while C is written
    assert (cursor.num_blocks, num_new) == (2, 2)
    # Blocks 1 and 2 left the window: scratch in their place; the chain goes on from the cursor.
    cursor, num_new = cache.extend(A + B + C, [0, 0, blocks[2]], 12, cursor)
    assert (cursor.num_blocks, num_new) == (3, 1)
    assert cache.register(A + B + C, [0, 0, blocks[2]], 12) == 0  # from the root: stops at the hole
    for block_id in reversed(blocks):
        pool.decref(block_id, retain=True)
    assert cache.match(A + B + C + [99]) == PrefixHit(tuple(blocks), None, 0)  # verified from the root
    cache.check_invariants()
    # Once the chain's last entry is evicted, nothing after it can be reached: extend does nothing.
    assert pool.allocate(pool.num_free_blocks + 3) is not None  # every free block, and evicts all three
    assert not cache.is_registered(blocks[2])
    assert cache.extend(A + B + C + A, [0, 0, 0, 5], 16, cursor) == (cursor, 0)
    cache.check_invariants()
