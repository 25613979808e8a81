"""Prefix retention per LoRA adapter: the same tokens under two adapters are different K/V, so blocks are
matched only within the namespace (adapter index) that registered them."""

from __future__ import annotations

import itertools

import pytest

from tgi_paged_backend.memory import KVCacheManager, PrefixMatch
from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.prefix_cache import CHAIN_START, PrefixCache, PrefixHit, chain_root

BS = 16
PROMPT = list(range(100, 140))  # two full blocks + 8 tokens
NAMESPACES = range(0, 64)


def make_manager() -> KVCacheManager:
    return KVCacheManager(num_blocks=17, block_size=BS, num_swap_blocks=4)


def run_and_free(m: KVCacheManager, request_id: int, namespace: int, prompt: list[int]) -> list[int]:
    """Prefill ``prompt`` under ``namespace`` from scratch, free it (full blocks are retained); its blocks."""
    m.add_request(request_id, namespace=namespace)
    assert m.match_prefix(request_id, prompt) == PrefixMatch()
    allocation = m.allocate(request_id, len(prompt))
    assert allocation is not None
    m.commit_tokens(request_id, prompt)
    m.free(request_id)
    m.check_invariants()
    return list(allocation.new_blocks)


def test_blocks_match_only_within_their_namespace() -> None:
    m = make_manager()
    blocks = run_and_free(m, 1, 1, PROMPT)
    assert m.num_retained_blocks == 2
    for request_id, namespace in ((2, 0), (3, 2), (4, 7)):
        m.add_request(request_id, namespace=namespace)
        assert m.match_prefix(request_id, PROMPT) == PrefixMatch()
        m.free(request_id)
    m.add_request(5, namespace=1)
    assert m.match_prefix(5, PROMPT) == PrefixMatch(2 * BS, 2, None, 0)
    assert m.block_tables([5])[0, :2].tolist() == blocks[:2]
    m.check_invariants()
    m.free(5)
    assert m.num_retained_blocks == 2


def test_no_copy_on_write_source_across_namespaces() -> None:
    m = make_manager()
    run_and_free(m, 1, 1, PROMPT)
    m.add_request(2, namespace=0)
    assert m.match_prefix(2, PROMPT[:10]) == PrefixMatch()
    m.add_request(3, namespace=1)
    match = m.match_prefix(3, PROMPT[:10])
    assert (match.num_shared_blocks, match.num_copy_tokens, match.copy_src is not None) == (0, 9, True)
    m.check_invariants()


def test_every_namespace_keeps_its_own_copy_of_the_same_tokens() -> None:
    m = make_manager()
    own = {ns: run_and_free(m, 10 + ns, ns, PROMPT)[:2] for ns in (0, 1, 2, 3)}
    assert len({b for blocks in own.values() for b in blocks}) == 8  # nothing shared across namespaces
    assert m.num_retained_blocks == 8
    for ns, blocks in own.items():
        m.add_request(20 + ns, namespace=ns)
        match = m.match_prefix(20 + ns, PROMPT)
        assert match == PrefixMatch(2 * BS, 2, None, 0), f"namespace {ns}"
        assert m.block_tables([20 + ns])[0, :2].tolist() == blocks, f"namespace {ns}"
    m.check_invariants()


def test_recompute_preemption_rematches_its_own_namespace() -> None:
    m = make_manager()
    m.add_request(1, namespace=1)
    m.match_prefix(1, PROMPT)
    allocation = m.allocate(1, len(PROMPT))
    assert allocation is not None
    m.commit_tokens(1, PROMPT)
    generated = list(range(500, 530))  # decode up to 70 tokens: four full blocks
    assert m.allocate(1, len(PROMPT) + len(generated)) is not None
    m.commit_tokens(1, generated, start=len(PROMPT))
    blocks = m.block_tables([1])[0, :4].tolist()
    history = PROMPT + generated
    assert m.preempt_recompute(1) == len(history)
    m.check_invariants()
    # Another adapter (or the base model) sees none of it.
    m.add_request(2, namespace=0)
    assert m.match_prefix(2, history) == PrefixMatch()
    m.free(2)
    # The preempted request resumes from its own retained blocks.
    match = m.match_prefix(1, history)
    assert match == PrefixMatch(4 * BS, 4, None, 0)
    assert m.block_tables([1])[0, :4].tolist() == blocks
    assert m.allocate(1, len(history)) is not None
    m.check_invariants()
    m.free(1)
    m.check_invariants()


# ------------------------------------------------------------------------------ PrefixCache directly
def make_cache() -> tuple[BlockPool, PrefixCache]:
    pool = BlockPool(33)
    cache = PrefixCache(pool, 4)
    pool.on_evict = cache.forget_block
    return pool, cache


def retire(pool: BlockPool, cache: PrefixCache, token_ids: list[int], root) -> list[int]:
    blocks = pool.allocate(len(token_ids) // 4)
    assert blocks is not None
    cache.register(token_ids, blocks, len(token_ids), root)
    for block_id in reversed(blocks):
        pool.decref(block_id, retain=cache.is_registered(block_id))
    return blocks


def test_base_namespace_is_the_plain_chain_start() -> None:
    assert chain_root(0) == CHAIN_START


def test_roots_are_distinct_and_their_serials_never_an_entrys() -> None:
    roots = [chain_root(ns) for ns in NAMESPACES]
    assert all(r.num_blocks == 0 and r.parent_serial <= 0 for r in roots)
    assert len({r.parent_serial for r in roots}) == len(roots)
    pool, cache = make_cache()
    for ns in (0, 1, 2):
        retire(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8], chain_root(ns))
    serials = {e.serial for e in cache._by_serial.values()}  # noqa: SLF001
    assert min(serials) > 0 and not serials & {r.parent_serial for r in roots}
    cache.check_invariants()


def test_roots_have_pairwise_distinct_hashes() -> None:
    """Distinct root hashes keep namespaces from colliding in the hash index (a collision is no false
    sharing, but it stops the second namespace's chain: a permanent cache miss for it)."""
    hashes = {ns: chain_root(ns).parent_hash for ns in NAMESPACES}
    clashes = [(a, b) for a, b in itertools.combinations(NAMESPACES, 2) if hashes[a] == hashes[b]]
    assert clashes == []


@pytest.mark.parametrize("namespaces", [(1, 3), (1, 2), (0, 1)])
def test_same_tokens_register_and_match_per_root(namespaces: tuple[int, int]) -> None:
    pool, cache = make_cache()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    first, second = (chain_root(ns) for ns in namespaces)
    blocks_first = retire(pool, cache, tokens[:8], first)
    blocks_second = retire(pool, cache, tokens[:8], second)
    assert cache.num_entries == 4
    assert cache.match(tokens, first) == PrefixHit(tuple(blocks_first), None, 0)
    assert cache.match(tokens, second) == PrefixHit(tuple(blocks_second), None, 0)
    assert cache.match(tokens, chain_root(9)) == PrefixHit()
    cache.check_invariants()
