"""KVCacheManager at block sizes 1 and 2: exact block counts, slots, prefix reuse, preemption, swap.

Block size 1 is stock TGI's flashinfer layout (one token per page): every token is its own block, so a
request never has a partly filled last block, slots equal block ids, and the prefix cache keys single
tokens. Block size 2 is the smallest size with a partial last block (copy-on-write of one token).
"""

from __future__ import annotations

import numpy as np
import pytest
from memory_sim import KVSim

from tgi_paged_backend.memory import Allocation, BlockCopy, KVCacheManager, PrefixMatch, SwapPlan

NUM_BLOCKS = 41  # 40 usable + the scratch block


def make_manager(block_size: int, num_swap_blocks: int = 12) -> tuple[KVCacheManager, KVSim]:
    m = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=block_size, num_swap_blocks=num_swap_blocks)
    return m, KVSim(NUM_BLOCKS, block_size, num_swap_blocks)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def run_prompt(
    m: KVCacheManager, sim: KVSim, request_id: int, prompt: list[int], virtual_blocks: tuple[int, ...] = ()
) -> tuple[PrefixMatch, Allocation]:
    m.add_request(request_id, virtual_blocks)
    match = m.match_prefix(request_id, prompt)
    allocation = m.allocate(request_id, len(prompt))
    assert allocation is not None
    sim.apply_allocation(allocation)
    sim.write(m, request_id, prompt, match.num_cached_tokens, len(prompt))
    m.commit_tokens(request_id, prompt)
    m.check_invariants()
    sim.assert_holds(m, request_id, prompt, len(prompt))
    return match, allocation


def decode(m: KVCacheManager, sim: KVSim, request_id: int, history: list[int], token: int) -> Allocation:
    allocation = m.allocate(request_id, len(history) + 1)
    assert allocation is not None and allocation.copies == ()
    history.append(token)
    sim.write(m, request_id, history, len(history) - 1, len(history))
    m.commit_tokens(request_id, history)
    m.check_invariants()
    return allocation


@pytest.mark.parametrize("block_size, num_blocks", [(1, 5), (2, 3)])
def test_five_token_prompt_holds_exactly_ceil_blocks(block_size, num_blocks):
    m, sim = make_manager(block_size)
    _, allocation = run_prompt(m, sim, 1, tokens(5))
    assert allocation == Allocation(tuple(range(1, num_blocks + 1)), ())
    assert m.num_used_blocks == num_blocks and m.num_free_blocks == 40 - num_blocks
    np.testing.assert_array_equal(m.block_tables([1]), [list(range(1, num_blocks + 1))])
    # Position p lives at block p // bs, offset p % bs: fresh blocks are 1, 2, ... in token order.
    np.testing.assert_array_equal(m.slot_mapping([1], [0], [5]), [block_size + p for p in range(5)])
    stats = m.stats()
    assert stats.internal_waste_slots == num_blocks * block_size - 5  # 0 at block size 1, 1 at 2
    m.free(1)
    assert m.num_used_blocks == 0 and m.num_retained_blocks == 5 // block_size
    m.check_invariants()


@pytest.mark.parametrize("block_size", [1, 2])
def test_decode_takes_a_block_every_block_size_tokens(block_size):
    m, sim = make_manager(block_size)
    history = tokens(5)
    run_prompt(m, sim, 1, history)
    taken = []
    for step in range(6):
        assert m.blocks_needed(1, len(history) + 1) == (1 if len(history) % block_size == 0 else 0)
        taken.append(len(decode(m, sim, 1, history, 100 + step).new_blocks))
    assert taken == ([1] * 6 if block_size == 1 else [0, 1, 0, 1, 0, 1])
    assert m.num_used_blocks == -(-11 // block_size)
    sim.assert_holds(m, 1, history, 11)
    np.testing.assert_array_equal(
        m.decode_slot_mapping([1], [10]), [m.block_tables([1])[0, 10 // block_size] * block_size + 10 % block_size]
    )


@pytest.mark.parametrize("block_size", [1, 2])
def test_router_slots_translate_per_token(block_size):
    m, sim = make_manager(block_size)
    virtual = tuple(range(90, 90 + -(-12 // block_size)))[::-1]  # the router's tail blocks, reversed
    run_prompt(m, sim, 1, tokens(7), virtual)
    assert m.num_used_blocks == -(-7 // block_size)  # lazily backed: 7 tokens, not the 12 reserved
    pos = np.arange(7)
    router = np.asarray(virtual)[pos // block_size] * block_size + pos % block_size
    np.testing.assert_array_equal(m.virtual_to_physical_slots(1, router), m.slot_mapping([1], [0], [7]))
    with pytest.raises(ValueError, match="not backed"):
        m.virtual_to_physical_slots(1, np.array([virtual[-1] * block_size]))
    with pytest.raises(ValueError, match="exceed"):
        m.allocate(1, len(virtual) * block_size + 1)


def test_liveness_probe_at_block_size_one():
    m, sim = make_manager(1)
    run_prompt(m, sim, 2**64 - 1, [42], (0,))
    assert m.num_used_blocks == 0
    np.testing.assert_array_equal(m.slot_mapping([2**64 - 1], [0], [1]), [0])
    m.free(2**64 - 1)
    m.check_invariants()
    assert m.num_free_blocks == 40


def test_prefix_reuse_at_block_size_one_is_token_granular():
    m, sim = make_manager(1)
    prompt = tokens(10)
    run_prompt(m, sim, 1, prompt)
    m.free(1)
    assert m.num_retained_blocks == 10  # every token is a full block: nothing is lost to a partial tail
    # Same prompt: all but the last token are shared, no copy-on-write (there is no partial block).
    match, allocation = run_prompt(m, sim, 2, prompt)
    assert match == PrefixMatch(9, 9, None, 0)
    assert allocation.copies == () and len(allocation.new_blocks) == 1
    # Diverging after 6 tokens: exactly 6 shared blocks, held by two live requests.
    match, _ = run_prompt(m, sim, 3, prompt[:6] + [77, 78])
    assert match == PrefixMatch(6, 6, None, 0)
    assert m.request_memory(3).num_exclusive_blocks == 2
    np.testing.assert_array_equal(m.block_tables([3])[0, :6], m.block_tables([2])[0, :6])
    assert m.stats().num_prefix_hit_tokens == 15


def test_prefix_reuse_at_block_size_two_copies_one_token():
    m, sim = make_manager(2)
    prompt = tokens(10)
    run_prompt(m, sim, 1, prompt)  # blocks 1..5, all full
    m.free(1)
    assert m.num_retained_blocks == 5
    match, allocation = run_prompt(m, sim, 2, prompt)
    # Blocks 1..4 shared (8 tokens); block 5's first token is copied so the last one is computed.
    assert match == PrefixMatch(9, 4, 5, 1)
    assert allocation == Allocation((6,), (BlockCopy(5, 6, 1),))
    assert m.num_retained_blocks == 1  # the copy source is retained again once the copy is issued
    # An odd-length prompt: its partial last block is not retained.
    run_prompt(m, sim, 3, tokens(7, 500))
    m.free(3)
    match, _ = run_prompt(m, sim, 4, tokens(7, 500) + [1])
    assert match == PrefixMatch(6, 3, None, 0)


@pytest.mark.parametrize("block_size", [1, 2])
def test_recompute_preemption_and_resume(block_size):
    m, sim = make_manager(block_size)
    history = tokens(9)
    run_prompt(m, sim, 1, history)
    decode(m, sim, 1, history, 300)
    assert m.preempt_recompute(1) == 10
    assert m.num_used_blocks == 0 and m.num_retained_blocks == 10 // block_size
    match = m.match_prefix(1, history)
    assert match.num_cached_tokens == 9  # everything but the last token comes back from retention
    allocation = m.allocate(1, 10)
    assert allocation is not None
    sim.apply_allocation(allocation)
    sim.write(m, 1, history, 9, 10)
    m.commit_tokens(1, history)
    m.check_invariants()
    sim.assert_holds(m, 1, history, 10)
    assert m.num_used_blocks == -(-10 // block_size)


@pytest.mark.parametrize("block_size", [1, 2])
def test_swap_out_and_in_moves_one_block_per_block_size_tokens(block_size):
    m, sim = make_manager(block_size, num_swap_blocks=12)
    history = tokens(9)
    run_prompt(m, sim, 1, history)
    num = -(-9 // block_size)
    plan = m.swap_out(1)
    assert plan == SwapPlan(1, "out", tuple(range(1, num + 1)), tuple(range(num)))
    sim.apply_swap(plan)
    assert m.num_swapped_blocks == num and m.num_used_blocks == 0
    assert m.stats().num_swapped_requests == 1
    other = tokens(2 * block_size + 1, 500)  # takes some of the blocks just released
    run_prompt(m, sim, 2, other)
    plan = m.swap_in(1)
    assert plan is not None and len(plan.dst_blocks) == num and plan.src_blocks == tuple(range(num))
    sim.apply_swap(plan)
    sim.assert_holds(m, 1, history, 9)
    sim.assert_holds(m, 2, other, len(other))
    decode(m, sim, 1, history, 7)
    sim.assert_holds(m, 1, history, 10)
    # A request with more blocks than the swap space cannot be swapped out.
    run_prompt(m, sim, 3, tokens(13 * block_size, 900))
    assert not m.can_swap_out(3) and m.swap_out(3) is None
    for rid in (1, 2, 3):
        m.free(rid)
    m.check_invariants()
    assert m.num_used_blocks == 0 and m.num_swapped_blocks == 0


@pytest.mark.parametrize("block_size", [1, 2])
def test_pool_exhaustion_is_all_or_nothing_and_reclaims_retained_blocks(block_size):
    m, sim = make_manager(block_size)
    run_prompt(m, sim, 1, tokens(20 * block_size))  # half the pool
    m.free(1)
    assert m.num_retained_blocks == 20
    run_prompt(m, sim, 2, tokens(30 * block_size, 1000))  # 20 free + 10 reclaimed (tail first)
    assert m.num_retained_blocks == 10 and m.num_free_blocks == 0
    m.add_request(3)
    assert m.allocate(3, 10 * block_size + 1) is None  # 11 blocks needed, 10 available: nothing taken
    assert m.num_retained_blocks == 10
    match = m.match_prefix(3, tokens(20 * block_size))  # the head of request 1's chain survived
    assert match.num_shared_blocks == 10
    assert m.allocate(3, 20 * block_size) is None
    m.check_invariants()
