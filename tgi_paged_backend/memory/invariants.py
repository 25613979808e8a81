"""The books of a :class:`~.kv_cache_manager.KVCacheManager` checked against each other (tests, debug).

Kept apart from the manager so the manager holds only the operations. Everything here only reads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.block_table import BlockTableArray
from tgi_paged_backend.memory.page_map import PageMap
from tgi_paged_backend.memory.prefix_cache import NullPrefixCache, PrefixCache
from tgi_paged_backend.memory.swap_space import SwapSpace
from tgi_paged_backend.memory.types import SCRATCH_BLOCK
from tgi_paged_backend.memory.window_reclaim import num_blocks_outside_window


def check_manager_invariants(
    *,
    pool: BlockPool,
    prefix: PrefixCache | NullPrefixCache,
    swap: SwapSpace,
    table: BlockTableArray,
    requests: Mapping[int, PageMap],
    block_size: int,
    window: int | None,
) -> None:
    """Pool, prefix cache, swap space and every page map agree; refcount == number of holders.

    Holes (sliding-window reclaim) are a scratch-mapped prefix of the page map and never cover a
    position that the request's latest query reads.
    """
    pool.check_invariants()
    prefix.check_invariants()
    swap.check_invariants()
    table.check_free_rows()
    assert table.num_live_rows == len(requests)
    holders: Counter[int] = Counter()
    num_swapped = 0
    rows: set[int] = set()
    for request_id, req in requests.items():
        assert req.row not in rows, "two requests share a block-table row"
        rows.add(req.row)
        table.check_row(req.row, req.blocks)
        assert req.num_committed <= len(req.token_ids)
        if req.virtual_blocks:
            assert len(req.blocks) <= len(req.virtual_blocks)
        if req.num_holes:
            assert window is not None, f"request {request_id}: holes without a sliding window"
            last_query = max(req.num_allocated_tokens - 1, 0)
            assert req.num_holes <= num_blocks_outside_window(last_query, window, block_size), (
                f"request {request_id}: a hole inside the window"
            )
        if req.swapped is not None:
            assert not req.blocks and req.cow_src is None
            num_swapped += len(req.swapped)
            continue
        assert req.num_holes <= len(req.blocks)
        assert req.num_committed <= len(req.blocks) * block_size + req.num_cow_tokens
        for index, block_id in enumerate(req.blocks):
            if block_id == SCRATCH_BLOCK:
                assert index < req.num_holes or req.virtual_blocks[index] == SCRATCH_BLOCK, (
                    f"request {request_id}: stray scratch"
                )
            else:
                assert index >= req.num_holes, f"request {request_id}: a hole still holds block {block_id}"
                holders[block_id] += 1
        if req.cow_src is not None:
            holders[req.cow_src] += 1
    for block_id in range(1, pool.num_blocks):
        assert pool.refcount(block_id) == holders[block_id], (
            f"block {block_id}: refcount {pool.refcount(block_id)} != {holders[block_id]} holders"
        )
    assert num_swapped == swap.num_used_blocks
