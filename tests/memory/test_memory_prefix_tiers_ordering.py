"""The host tier's landing rule (issue 42): an entry becomes loadable, and is written through to disk,
only once the copy that fills it has run, i.e. once its offload was taken into a step (``take_moves``)
and that step's copies ran (``moves_landed``). An offload still waiting in the manager when a step
ends (issued after the step took its moves) is not landed by that step: its rows hold nothing yet."""

from __future__ import annotations

from tgi_paged_backend.memory.host_tier import HostEntry
from tgi_paged_backend.memory.kv_cache_manager import KVCacheManager
from tgi_paged_backend.memory.prefix_cache import chain_root
from tgi_paged_backend.memory.prefix_tiers import TierSetup

BS = 4


def _manager(spilled: list[HostEntry]) -> KVCacheManager:
    return KVCacheManager(num_blocks=7, block_size=BS, tiers=TierSetup(8, b"order", spill=spilled.append))


def _run(m: KVCacheManager, rid: int, tokens: list[int]) -> None:
    m.add_request(rid)
    m.match_prefix(rid, tokens)
    assert m.allocate(rid, len(tokens)) is not None
    m.commit_tokens(rid, tokens)
    m.free(rid)


def test_an_offload_not_yet_taken_is_not_landed():
    spilled: list[HostEntry] = []
    m = _manager(spilled)
    tiers = m.tiers
    assert tiers is not None
    first = list(range(100, 100 + 3 * BS))
    _run(m, 1, first)  # 3 retained blocks
    tiers.moves_landed()
    _run(m, 2, list(range(200, 200 + 6 * BS)))  # the 6-block pool evicts them: 3 offloads issued
    assert tiers.counters.offloaded_blocks > 0 and tiers.moves
    tiers.moves_landed()  # a step ended without taking those moves: nothing ran
    assert not spilled, "an entry was written through before its offload ran"
    assert tiers.host_chain(first + [0], chain_root(0), None)[1] == [], "loadable before its copy ran"
    moves = m.take_tier_moves()
    assert moves and all(kind == "offload" for kind, _, _ in moves)
    tiers.moves_landed()  # now they ran
    assert len(spilled) == tiers.counters.offloaded_blocks
    assert len(tiers.host_chain(first + [0], chain_root(0), None)[1]) == 3
    tiers.host.check_invariants()
    m.check_invariants()


def test_an_entry_evicted_while_pending_is_never_landed_nor_spilled():
    """A pending entry the host tier evicts (its rows go to a newer entry) is dropped silently."""
    spilled: list[HostEntry] = []
    m = KVCacheManager(num_blocks=4, block_size=BS, tiers=TierSetup(2, b"order", spill=spilled.append))
    tiers = m.tiers
    assert tiers is not None
    _run(m, 1, list(range(100, 100 + 3 * BS)))
    _run(m, 2, list(range(200, 200 + 3 * BS)))  # evicts 3 blocks into 2 rows: one pending entry evicted
    assert tiers.host.num_evicted > 0
    m.take_tier_moves()
    tiers.moves_landed()
    assert len(spilled) == tiers.host.num_entries == 2
    assert all(e.block.key in tiers.host for e in spilled)
    tiers.host.check_invariants()
