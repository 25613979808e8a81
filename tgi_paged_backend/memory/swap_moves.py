"""Swap preemption of one request over every KV group, sharing the host tier.

A swapped-out request's blocks go to CPU swap space, except those whose KV a landed host-tier entry
already holds (typically a prefix the request loaded from the host tier, or one another turn of the
conversation left there): copying them again would spend swap space and bandwidth on bytes host RAM
has. The request keeps those entries pinned while it is swapped out, and swap-in loads them back from
the host tier (a ``load`` move) next to the swap copies. The manager (:class:`.kv_cache_manager.KVCacheManager`)
calls these functions with its groups and the request's page maps (group order).
"""

from __future__ import annotations

from collections.abc import Sequence

from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.kv_group import KVGroup, concat_moves
from tgi_paged_backend.memory.page_map import PageMap
from tgi_paged_backend.memory.prefix_tiers import PrefixTiers
from tgi_paged_backend.memory.swap_space import SwapSpace


def held_by_host(tiers: PrefixTiers | None, maps: Sequence[PageMap]) -> tuple[list[dict[int, int]], list[bytes]]:
    """Per group ``{index in the map: host row}`` of the blocks the host tier holds, and their entries' keys."""
    if tiers is None:
        return [{} for _ in maps], []
    return tiers.held_rows([req.blocks for req in maps])


def can_swap_out(maps: Sequence[PageMap], swap: SwapSpace, tiers: PrefixTiers | None) -> bool:
    """Resident, holds blocks, and swap space has room for those the host tier does not hold."""
    if any(req.swapped is not None or req.cow_src is not None for req in maps):
        return False
    num = sum(req.num_physical_blocks for req in maps)
    if num == 0:
        return False
    held, _ = held_by_host(tiers, maps)
    return swap.can_allocate(num - sum(len(h) for h in held))


def swap_out(
    groups: Sequence[KVGroup], maps: Sequence[PageMap], swap: SwapSpace, tiers: PrefixTiers | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Release a resident request's blocks to swap space (the caller checked :func:`can_swap_out`);
    returns the ``(device blocks, swap blocks)`` to copy."""
    held, keys = held_by_host(tiers, maps)
    moves = [group.swap_out(req, swap, h) for group, req, h in zip(groups, maps, held)]
    if tiers is not None and keys:
        tiers.keep_for_swap(keys, sum(len(h) for h in held))
        maps[0].swap_pins = tuple(keys)
    return concat_moves(moves)


def swap_in(
    groups: Sequence[KVGroup], maps: Sequence[PageMap], swap: SwapSpace, pool: BlockPool, tiers: PrefixTiers | None
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Bring a swapped-out request back onto fresh pool blocks; returns the ``(swap blocks, device blocks)``
    to copy (the host tier's loads join its moves), or ``None`` when the pool lacks room."""
    assert all(req.swapped is not None for req in maps), "the request is not swapped out"
    if sum(req.num_swapped_blocks for req in maps) > pool.num_available_blocks:
        return None
    moves = [group.swap_in(req, swap) for group, req in zip(groups, maps)]
    keys, maps[0].swap_pins = maps[0].swap_pins, ()
    rows, blocks = concat_moves([loads for _, loads in moves])
    if tiers is not None:
        tiers.load_swapped(list(rows), list(blocks), keys)
    assert tiers is not None or not rows, "blocks left in a host tier that does not exist"
    return concat_moves([copies for copies, _ in moves])


def release_swapped(maps: Sequence[PageMap], swap: SwapSpace, tiers: PrefixTiers | None) -> None:
    """A swapped-out request finishes (or is cancelled): its swap blocks and host pins go."""
    for req in maps:
        swap.free(req.swapped or [])
    if tiers is not None:
        tiers.release_swapped(maps[0].swap_pins)
    maps[0].swap_pins = ()
