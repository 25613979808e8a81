"""Memory statistics and waste accounting (one snapshot per engine step, fed to telemetry).

Waste comes in three kinds (``tgi_paged_kv_waste_ratio{kind}``):

- **internal**: slots of physically mapped blocks that hold no written token -- in steady state the
  unfilled tail of each request's last block (at most ``block_size - 1`` per request).
- **reservation**: slots the router reserved (its virtual blocks) beyond the blocks that back the
  request. Under stock TGI these are physical memory holding nothing; here they cost nothing, and the
  number shows what the lazy mapping saves.
- **external**: free (or reclaimable) blocks stranded because the head-of-line pending allocation
  needs more than are available. Paging makes every free block usable by any request, so this is 0
  unless memory is actually short; it is measured anyway.

Holes (blocks given back behind a sliding window, :mod:`.window_reclaim`) are no waste of any kind:
they hold nothing and cost nothing. They are counted apart (``num_hole_blocks`` now,
``num_reclaimed_blocks_total`` since start): what stock TGI would still hold for those positions.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.page_map import PageMap
from tgi_paged_backend.memory.swap_space import SwapSpace


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryStats:
    """Pool occupancy and waste at one instant. Block counts exclude the scratch block."""

    block_size: int
    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_retained_blocks: int
    num_swapped_blocks: int
    num_swap_total_blocks: int
    num_requests: int
    num_swapped_requests: int
    num_written_tokens: int
    """Token positions written or being written (committed, or backed on the engine's request),
    summed over requests resident on the device; positions in holes are not counted."""
    num_reserved_slots: int
    """Slots of all router (virtual) blocks of live requests."""
    internal_waste_slots: int
    reservation_waste_slots: int
    external_waste_blocks: int
    num_prefix_query_tokens: int
    """Cumulative prompt tokens looked up in the prefix cache."""
    num_prefix_hit_tokens: int
    """Cumulative prompt tokens served from the prefix cache (shared or copied)."""
    num_hole_blocks: int = 0
    """Page-map blocks of live requests given back behind the sliding window (holes)."""
    num_reclaimed_blocks_total: int = 0
    """Cumulative blocks given back to the pool by sliding-window reclaim."""
    group_windows: tuple[int | None, ...] = ()
    """With KV layer groups: each group's window (``None``: full attention); ``()`` with one group."""
    group_blocks: tuple[int, ...] = ()
    """Device blocks each group's page maps of live requests hold (same order as :attr:`group_windows`)."""
    group_hole_blocks: tuple[int, ...] = ()
    """Blocks each group gave back behind its window for live requests (holes)."""
    group_internal_waste_slots: tuple[int, ...] = ()
    """Each group's unfilled slots in the blocks it holds (its part of :attr:`internal_waste_slots`)."""

    @property
    def num_physical_tokens(self) -> int:
        """Token positions the pool holds: with KV layer groups a position takes a block slot in every
        group, so the blocks' positions over the groups."""
        return self.num_total_blocks // max(len(self.group_windows), 1) * self.block_size

    def group_internal_waste_ratio(self, group: int) -> float:
        """Group ``group``'s internal waste over the slots of the blocks it holds."""
        return self.group_internal_waste_slots[group] / max(self.group_blocks[group] * self.block_size, 1)

    @property
    def usage_ratio(self) -> float:
        """Used blocks over usable blocks."""
        return self.num_used_blocks / max(self.num_total_blocks, 1)

    @property
    def internal_waste_ratio(self) -> float:
        """Internal waste over the slots of used blocks."""
        return self.internal_waste_slots / max(self.num_used_blocks * self.block_size, 1)

    @property
    def reservation_waste_ratio(self) -> float:
        """Reserved-but-unbacked slots over all router-reserved slots."""
        return self.reservation_waste_slots / max(self.num_reserved_slots, 1)

    @property
    def external_waste_ratio(self) -> float:
        """Stranded blocks over usable blocks."""
        return self.external_waste_blocks / max(self.num_total_blocks, 1)


def request_waste(
    *,
    num_written_tokens: int,
    num_mapped_blocks: int,
    num_reserved_blocks: int,
    block_size: int,
    num_hole_blocks: int = 0,
) -> tuple[int, int]:
    """Internal and reservation waste (in slots) of one request.

    Args:
        num_written_tokens: Tokens whose K/V is written and still held (holes excluded).
        num_mapped_blocks: Blocks backing the request (physical, or CPU while swapped out).
        num_reserved_blocks: Router virtual blocks (0 for self-managed requests).
        block_size: Tokens per block.
        num_hole_blocks: Leading blocks given back behind the sliding window: neither kind of waste.

    Returns:
        ``(internal_slots, reservation_slots)``.
    """
    internal = max(num_mapped_blocks * block_size - num_written_tokens, 0)
    reservation = max(num_reserved_blocks - num_mapped_blocks - num_hole_blocks, 0) * block_size
    return internal, reservation


def stranded_blocks(num_available_blocks: int, num_pending_blocks: int) -> int:
    """External waste: available blocks that cannot serve a pending all-or-nothing allocation."""
    return num_available_blocks if num_pending_blocks > num_available_blocks else 0


@dataclass(frozen=True, slots=True)
class WasteSummary:
    """Waste and token totals over a set of page maps (slots unless named otherwise)."""

    internal_slots: int
    reservation_slots: int
    num_written_tokens: int
    num_reserved_slots: int
    num_swapped_requests: int
    num_hole_blocks: int = 0


def summarize_waste(page_maps: Iterable[PageMap], block_size: int) -> WasteSummary:
    """Sum :func:`request_waste` over live requests; swapped-out ones hold nothing on the device."""
    internal = reservation = written = reserved = swapped = holes = 0
    for pm in page_maps:
        num_reserved = len(pm.virtual_blocks)
        reserved += num_reserved * block_size
        if pm.swapped is not None:
            swapped += 1
            num_written, num_mapped = 0, 0
        else:
            num_written = max(pm.num_committed, pm.num_allocated_tokens) - pm.num_holes * block_size
            num_mapped = len(pm.blocks) - pm.num_holes
        written += num_written
        holes += pm.num_holes
        slots = request_waste(
            num_written_tokens=num_written,
            num_mapped_blocks=num_mapped,
            num_reserved_blocks=num_reserved,
            block_size=block_size,
            num_hole_blocks=pm.num_holes,
        )
        internal += slots[0]
        reservation += slots[1]
    return WasteSummary(internal, reservation, written, reserved, swapped, holes)


def pool_stats(
    *,
    pool: BlockPool,
    swap: SwapSpace,
    groups: Sequence[tuple[int | None, Collection[PageMap]]],
    block_size: int,
    num_pending_blocks: int,
    num_prefix_query_tokens: int,
    num_prefix_hit_tokens: int,
    num_reclaimed_blocks_total: int,
) -> MemoryStats:
    """The snapshot of a pool whose live requests are mapped by ``groups`` (each group's window and page
    maps; group 0 carries the router's booking and the token counts, one page map per request)."""
    wastes = [summarize_waste(maps, block_size) for _, maps in groups]
    per_group: dict[str, Any] = {}
    if len(groups) > 1:
        per_group = dict(
            group_windows=tuple(window for window, _ in groups),
            group_blocks=tuple(sum(m.num_physical_blocks for m in maps if m.swapped is None) for _, maps in groups),
            group_hole_blocks=tuple(w.num_hole_blocks for w in wastes),
            group_internal_waste_slots=tuple(w.internal_slots for w in wastes),
        )
    return MemoryStats(
        block_size=block_size,
        num_total_blocks=pool.num_usable_blocks,
        num_free_blocks=pool.num_free_blocks,
        num_used_blocks=pool.num_used_blocks,
        num_retained_blocks=pool.num_retained_blocks,
        num_swapped_blocks=swap.num_used_blocks,
        num_swap_total_blocks=swap.num_blocks,
        num_requests=len(groups[0][1]),
        num_swapped_requests=wastes[0].num_swapped_requests,
        num_written_tokens=wastes[0].num_written_tokens,
        num_reserved_slots=wastes[0].num_reserved_slots,  # the router's booking: one per request
        internal_waste_slots=sum(w.internal_slots for w in wastes),
        reservation_waste_slots=wastes[0].reservation_slots,
        external_waste_blocks=stranded_blocks(pool.num_available_blocks, num_pending_blocks),
        num_prefix_query_tokens=num_prefix_query_tokens,
        num_prefix_hit_tokens=num_prefix_hit_tokens,
        num_hole_blocks=sum(w.num_hole_blocks for w in wastes),
        num_reclaimed_blocks_total=num_reclaimed_blocks_total,
        **per_group,
    )
