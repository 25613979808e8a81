"""The books of a :class:`~.kv_cache_manager.KVCacheManager` checked against each other (tests, debug).

Kept apart from the manager so the manager holds only the operations. Everything here only reads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tgi_paged_backend.memory.attached_blocks import AttachedBlocks
from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.page_map import PageMap
from tgi_paged_backend.memory.swap_space import SwapSpace
from tgi_paged_backend.memory.types import SCRATCH_BLOCK
from tgi_paged_backend.memory.window_reclaim import num_blocks_outside_window

if TYPE_CHECKING:
    from tgi_paged_backend.memory.kv_group import KVGroup


def check_manager_invariants(
    *,
    pool: BlockPool,
    groups: Sequence[KVGroup],
    swap: SwapSpace,
    block_size: int,
) -> None:
    """Pool, prefix registries, swap space and every group's page maps agree; refcount == number of
    holders over all groups; a block belongs to one group at a time.

    Holes (sliding-window reclaim) are a scratch-mapped prefix of a page map and never cover a
    position that the request's latest query reads in its group's window.
    """
    pool.check_invariants()
    for group in groups:
        if isinstance(group.prefix, AttachedBlocks):
            group.prefix.check_invariants()
        else:
            group.prefix.check_invariants(every_retained=len(groups) == 1)
        group.table.check_free_rows()
        assert group.table.num_live_rows == len(group.requests)
        assert group.requests.keys() == groups[0].requests.keys(), "every request has a page map in every group"
    if len(groups) > 1:
        for block_id in pool.retained_lru():
            owners = [g for g, group in enumerate(groups) if group.prefix.is_registered(block_id)]
            assert len(owners) == 1, f"retained block {block_id} is registered in groups {owners}"
    holders: Counter[int] = Counter()
    owner: dict[int, int] = {}
    num_swapped = 0
    for g, group in enumerate(groups):
        rows: set[int] = set()
        for request_id, req in group.requests.items():
            assert req.row == groups[0].requests[request_id].row, "one block-table row per request in every group"
            assert req.row not in rows, "two requests share a block-table row"
            rows.add(req.row)
            num_swapped += _check_page_map(request_id, req, group, block_size, holders, owner, g)
    for block_id in range(1, pool.num_blocks):
        assert pool.refcount(block_id) == holders[block_id], (
            f"block {block_id}: refcount {pool.refcount(block_id)} != {holders[block_id]} holders"
        )
    assert num_swapped == swap.num_used_blocks


def _check_page_map(
    request_id: int,
    req: PageMap,
    group: KVGroup,
    block_size: int,
    holders: Counter[int],
    owner: dict[int, int],
    g: int,
) -> int:
    """One page map of group ``g`` against its table row; counts its holdings. Returns its swapped blocks."""
    group.table.check_row(req.row, req.blocks)
    assert req.num_committed <= len(req.token_ids)
    if req.virtual_blocks:
        assert len(req.blocks) <= len(req.virtual_blocks)
    if req.num_holes:
        # no hole where a coming query reads: the next one is at num_allocated_tokens (a release stands
        # when its step's allocation fails, and that step's first query is where the next one will be)
        assert group.window is not None, f"request {request_id}: holes without a sliding window"
        next_query = req.num_allocated_tokens
        assert req.num_holes <= num_blocks_outside_window(next_query, group.window, block_size), (
            f"request {request_id}: a hole inside the window"
        )
    if req.swapped is not None:
        assert not req.blocks and req.cow_src is None
        return len(req.swapped)
    assert req.num_holes <= len(req.blocks)
    assert req.num_committed <= len(req.blocks) * block_size + req.num_cow_tokens
    held = [b for b in req.blocks if b != SCRATCH_BLOCK] + ([req.cow_src] if req.cow_src is not None else [])
    for index, block_id in enumerate(req.blocks):
        if block_id == SCRATCH_BLOCK:
            assert index < req.num_holes or req.virtual_blocks[index] == SCRATCH_BLOCK, (
                f"request {request_id}: stray scratch"
            )
        else:
            assert index >= req.num_holes, f"request {request_id}: a hole still holds block {block_id}"
    for block_id in held:
        holders[block_id] += 1
        assert owner.setdefault(block_id, g) == g, f"block {block_id} is held in groups {owner[block_id]} and {g}"
    return 0
