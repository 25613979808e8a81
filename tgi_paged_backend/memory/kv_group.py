"""One KV group's books: a page map per request, its block-table rows and its prefix registry.

A model's attention layers form one group, or several when full and sliding-window layers mix
(:mod:`.layer_groups`). Each group maps every request's positions to blocks of the one shared
:class:`~.block_pool.BlockPool`; a sliding group gives back the blocks behind its window
(:mod:`.window_reclaim`). :class:`~.kv_cache_manager.KVCacheManager` runs every operation on every group
(all or nothing across groups); this module is the part that concerns one group.

Prefix registries: group 0 (the *anchor*) keeps the verified token chains (:class:`PrefixCache`); with
several groups every other group attaches its blocks to the anchor's entries
(:class:`~.attached_blocks.AttachedBlocks`), so a hit is the anchor's, cut where a group lacks a block
it needs (:meth:`KVGroup.attached_hit`: a sliding group only the window the hit point reads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tgi_paged_backend.memory.attached_blocks import AttachedBlocks
from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.block_table import BlockTableArray
from tgi_paged_backend.memory.page_map import PageMap
from tgi_paged_backend.memory.prefix_cache import NullPrefixCache, PrefixCache, PrefixHit
from tgi_paged_backend.memory.swap_space import SwapSpace
from tgi_paged_backend.memory.types import SCRATCH_BLOCK, BlockCopy
from tgi_paged_backend.memory.window_reclaim import num_blocks_outside_window, release_blocks_outside_window


@dataclass(slots=True, eq=False)
class KVGroup:
    """The page maps of one layer group over the shared pool."""

    pool: BlockPool
    block_size: int
    window: int | None
    """The group's sliding window (blocks behind it are given back); ``None``: it keeps every block."""
    prefix: PrefixCache | NullPrefixCache | AttachedBlocks
    """The anchor's (group 0) registry of verified chains, or another group's blocks attached to it."""
    table: BlockTableArray
    requests: dict[int, PageMap] = field(default_factory=dict)
    tracks_serials: bool = False
    """The anchor of several groups: its page maps keep the serials of their chains (``PageMap.serials``)."""

    # ----------------------------------------------------------------------------- matching
    def share(self, req: PageMap, shared: Sequence[int], cow_src: int | None, num_cow: int) -> None:
        """Map the prefix hit's ``shared`` blocks (and pin its copy-on-write source) into ``req``; leading
        scratch entries are holes (a sliding group's blocks behind the window of the hit point)."""
        req.num_holes = 0
        while req.num_holes < len(shared) and shared[req.num_holes] == SCRATCH_BLOCK:
            req.num_holes += 1
        for block_id in shared[req.num_holes :]:
            self.pool.incref(block_id)
        req.blocks = list(shared)
        self.table.append(req.row, shared)
        if cow_src is not None:
            self.pool.incref(cow_src)
            req.cow_src, req.num_cow_tokens = cow_src, num_cow
        req.num_committed = req.num_allocated_tokens = len(shared) * self.block_size + num_cow

    def match(self, req: PageMap) -> PrefixHit:
        """The registry's hit for ``req``'s token history, within its reservation (the anchor's)."""
        assert not isinstance(self.prefix, AttachedBlocks), "only the anchor group matches token chains"
        return self.prefix.match(req.token_ids, req.chain_root)

    def attached_hit(
        self, serials: Sequence[int], cow_serial: int | None, num_tokens: int
    ) -> tuple[list[int], int | None] | None:
        """This group's part of an anchor hit of ``num_tokens`` positions over the anchor entries
        ``serials`` (and ``cow_serial``): its blocks (scratch for those behind the window of the query
        at ``num_tokens``, which a sliding group does not need) and its copy source, or ``None`` when it
        lacks one it needs."""
        assert isinstance(self.prefix, AttachedBlocks)
        lo = 0
        if self.window is not None:
            lo = min(num_blocks_outside_window(max(num_tokens - 1, 0), self.window, self.block_size), len(serials))
        blocks = [SCRATCH_BLOCK] * lo
        for serial in serials[lo:]:
            block_id = self.prefix.block_for(serial)
            if block_id is None:
                return None
            blocks.append(block_id)
        cow = None if cow_serial is None else self.prefix.block_for(cow_serial)
        if cow_serial is not None and cow is None:
            return None
        return blocks, cow

    # ----------------------------------------------------------------------------- allocation
    def num_outside_window(self, req: PageMap, num_tokens: int) -> int:
        """Leading page-map blocks no query of a step ending at ``num_tokens`` reads (0 without a window);
        the step's first query is the position after what the request asked for before."""
        if self.window is None:
            return 0
        first_query = min(req.num_allocated_tokens, num_tokens - 1)
        return min(num_blocks_outside_window(first_query, self.window, self.block_size), len(req.blocks))

    def release_outside_window(self, req: PageMap, num_tokens: int, anchor_serials: Sequence[int] = ()) -> int:
        """Give back the blocks behind the window before a step ending at ``num_tokens``; returns how many
        (full committed ones are registered first: retained, and the chain stays whole)."""
        end = self.num_outside_window(req, num_tokens)
        if end <= req.num_holes:
            return 0
        self.register(req, anchor_serials)
        return release_blocks_outside_window(
            req, end, pool=self.pool, table=self.table, is_registered=self.prefix.is_registered
        )

    def blocks_returned(self, req: PageMap, num_tokens: int) -> int:
        """Blocks :meth:`release_outside_window` would hand back to the available blocks."""
        return sum(
            1
            for b in req.blocks[req.num_holes : self.num_outside_window(req, num_tokens)]
            if b != SCRATCH_BLOCK and self.pool.refcount(b) == 1
        )

    def map_new(self, req: PageMap, new: Sequence[int], num_blocks: int) -> tuple[BlockCopy, ...]:
        """Extend ``req`` to ``num_blocks`` blocks with the fresh pool blocks ``new``; the pending
        copy-on-write lands in the first of them."""
        mapped = req.extension(new, num_blocks)
        copies: tuple[BlockCopy, ...] = ()
        if req.cow_src is not None:
            assert mapped[0] != SCRATCH_BLOCK
            copies = (BlockCopy(req.cow_src, mapped[0], req.num_cow_tokens),)
            self.release_cow_source(req)
        req.blocks.extend(mapped)
        self.table.append(req.row, mapped)
        return copies

    def truncate(self, req: PageMap, num_tokens: int) -> int:
        """Forget positions from ``num_tokens`` on; blocks wholly past them go back. Returns how many."""
        assert req.swapped is None
        keep = max(-(-num_tokens // self.block_size), req.num_holes)
        dropped = req.blocks[keep:]
        req.num_committed = min(req.num_committed, num_tokens)
        req.num_allocated_tokens = min(req.num_allocated_tokens, num_tokens)
        del req.token_ids[num_tokens:]
        if not dropped:
            return 0
        assert req.cow_src is None, "a pending copy-on-write past the history"
        for block_id in reversed(dropped):
            if block_id != SCRATCH_BLOCK:
                assert not self.prefix.is_registered(block_id), "a retained block past the committed tokens"
                self.pool.decref(block_id, retain=False)
        del req.blocks[keep:]
        self.table.truncate(req.row, keep)
        return len(dropped)

    # ------------------------------------------------------------------------------ release
    def register(self, req: PageMap, anchor_serials: Sequence[int] = ()) -> None:
        """Register the full committed blocks: from the root, or past the holes from where the chain
        ended (it cannot restart behind them). The anchor of several groups goes on from where its chain
        ended while that entry lives; another group attaches its blocks to ``anchor_serials`` (the
        anchor's page map's, registered first)."""
        num_written = min(req.num_committed, len(req.blocks) * self.block_size)
        if isinstance(self.prefix, AttachedBlocks):
            self.prefix.attach(req.blocks, anchor_serials[: num_written // self.block_size], req.num_holes)
            return
        start = req.chain if req.num_holes else req.chain_root
        serials = None
        if self.tracks_serials:
            serials = req.serials
            if req.num_holes or (self.prefix.is_live(req.chain) and len(serials) == req.chain.num_blocks):
                start = req.chain
            else:
                start = req.chain_root
                serials.clear()
        req.chain = self.prefix.extend(req.token_ids, req.blocks, num_written, start, serials)[0]

    def release_cow_source(self, req: PageMap) -> None:
        assert req.cow_src is not None
        self.pool.decref(req.cow_src, retain=self.prefix.is_registered(req.cow_src))
        req.cow_src, req.num_cow_tokens = None, 0

    def release_device_blocks(self, req: PageMap, *, register: bool, anchor_serials: Sequence[int] = ()) -> None:
        """Unpin a pending copy source, optionally register full written blocks, drop all blocks.

        Released last-first so that, once retained, a chain's tail is evicted before its head (a block
        is only reachable through its parents)."""
        if req.cow_src is not None:
            self.release_cow_source(req)
        if register:
            self.register(req, anchor_serials)
        is_registered = self.prefix.is_registered
        for block_id in reversed(req.blocks):
            if block_id != SCRATCH_BLOCK:
                self.pool.decref(block_id, retain=is_registered(block_id))
        req.blocks = []
        self.table.clear(req.row)

    # --------------------------------------------------------------------------------- swap
    def swap_out(
        self, req: PageMap, swap: SwapSpace, held: Mapping[int, int] | None = None
    ) -> tuple[list[int], list[int]]:
        """Move ``req``'s live blocks (holes stay holes) to swap blocks the caller checked are free;
        returns ``(device blocks, swap blocks)`` to copy. ``held``: ``{index in req.blocks: host row}`` of
        blocks whose KV the host tier holds already: they are not copied (swap-in loads them from there)."""
        held = held or {}
        live = [(index, b) for index, b in enumerate(req.blocks) if b != SCRATCH_BLOCK]
        src = [b for index, b in live if index not in held]
        dst = swap.allocate(len(src))
        assert dst is not None
        req.swapped_host = [(n, held[index]) for n, (index, _) in enumerate(live) if index in held]
        req.num_swapped_positions = len(req.blocks)
        self.release_device_blocks(req, register=False)
        req.swapped = dst
        return src, dst

    def swap_in(self, req: PageMap, swap: SwapSpace) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
        """Bring ``req`` back onto fresh pool blocks the caller checked are available; returns
        ``(swap blocks, device blocks)`` to copy and ``(host rows, device blocks)`` to load."""
        swapped = iter(req.swapped or [])
        from_host = dict(req.swapped_host)
        dst = self.pool.allocate(req.num_swapped_blocks)
        assert dst is not None
        copies: tuple[list[int], list[int]] = ([], [])
        loads: tuple[list[int], list[int]] = ([], [])
        for n, block_id in enumerate(dst):
            src, into = loads if n in from_host else copies
            src.append(from_host[n] if n in from_host else next(swapped))
            into.append(block_id)
        swap.free(req.swapped or [])
        req.swapped, req.swapped_host = None, []
        req.blocks = [SCRATCH_BLOCK] * req.num_holes  # holes were not swapped: they come back as holes
        req.blocks.extend(req.extension(dst, req.num_swapped_positions))
        self.table.append(req.row, req.blocks)
        return copies, loads

    # ----------------------------------------------------------------------------- queries
    def virtual_to_physical_slots(self, req: PageMap, router_slots: np.ndarray) -> np.ndarray:
        """``req``'s physical slots of router slots (``virtual_block * block_size + offset``); virtual
        block 0 goes to the scratch block. ``ValueError`` for a slot outside ``req``'s virtual blocks or
        in a block not backed yet."""
        slots = np.asarray(router_slots, dtype=np.int64)
        virtual, offset = np.divmod(slots, self.block_size)
        physical = np.zeros_like(virtual)
        real = virtual != SCRATCH_BLOCK
        if real.any():
            index = req.virtual_block_indices(virtual[real])
            if (index >= len(req.blocks)).any():
                raise ValueError("router slot in a block not backed yet")
            physical[real] = self.table.table[req.row, index]
        return physical * self.block_size + offset

    def exclusive_blocks(self, req: PageMap) -> int:
        """Blocks only ``req`` holds (what preempting it frees)."""
        return sum(1 for b in req.blocks if b != SCRATCH_BLOCK and self.pool.refcount(b) == 1)


@dataclass(frozen=True, slots=True)
class GroupHit:
    """An anchor hit as every group maps it: per group its blocks (scratch for holes) and copy source."""

    parts: tuple[tuple[list[int], int | None], ...]
    num_cow_tokens: int


def cut_hit(groups: Sequence[KVGroup], hit: PrefixHit, limit: int | None) -> GroupHit | None:
    """The anchor's (``groups[0]``) ``hit``, at most ``limit`` blocks, cut (its copy-on-write run first,
    then whole blocks) until every other group has the blocks the hit point needs: a full group every
    one, a sliding group those its window reads there. ``None``: nothing is left."""
    num_shared = len(hit.block_ids) if limit is None else min(len(hit.block_ids), limit)
    cow_serial = hit.cow_serial if num_shared == len(hit.block_ids) else None
    while num_shared > 0 or cow_serial is not None:
        num_cow = hit.num_cow_tokens if cow_serial is not None else 0
        num_tokens = num_shared * groups[0].block_size + num_cow
        parts = [group.attached_hit(hit.serials[:num_shared], cow_serial, num_tokens) for group in groups[1:]]
        if all(part is not None for part in parts):
            cow_src = hit.cow_src if cow_serial is not None else None
            anchor = (list(hit.block_ids[:num_shared]), cow_src)
            return GroupHit((anchor, *(part for part in parts if part is not None)), num_cow)
        if cow_serial is not None:
            cow_serial = None
        else:
            num_shared -= 1
    return None


def concat_moves(moves: Sequence[tuple[list[int], list[int]]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every group's ``(src, dst)`` block moves as one source and one destination tuple."""
    return tuple(b for src, _ in moves for b in src), tuple(b for _, dst in moves for b in dst)


def group_windows(
    block_size: int, reclaim_window: int | None, groups: Sequence[int | None] | None
) -> tuple[int | None, ...]:
    """The windows of a manager's groups from its arguments (one group of ``reclaim_window`` without
    ``groups``); ``ValueError`` for a bad combination."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} is invalid: allowed >= 1")
    if groups is not None and reclaim_window is not None:
        raise ValueError("give reclaim_window or groups, not both")
    if reclaim_window is not None and reclaim_window < 1:
        raise ValueError(f"reclaim_window={reclaim_window} is invalid: allowed >= 1 or None")
    windows = tuple(groups) if groups is not None else (reclaim_window,)
    if not windows or any(w is not None and w < 1 for w in windows):
        raise ValueError(f"groups={windows} is invalid: allowed windows >= 1 or None, at least one group")
    return windows
