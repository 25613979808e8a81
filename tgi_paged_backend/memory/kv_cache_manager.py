"""The memory manager the engine uses: page maps, lazy physical blocks, prefix reuse, swap, waste.

Each request owns a :class:`~.page_map.PageMap`; physical blocks are mapped lazily, as a prefix of
it. A request is *resident* (its blocks are on the device -- possibly none yet, or none after a
recompute preemption) or *swapped* (its blocks are in CPU swap space) until :meth:`free`.

Retention: when a request frees (or is preempted for recompute), its full committed blocks --
prompt *and* generated tokens, since a chat follow-up re-sends both -- are registered in the prefix
cache and become retained (reclaimable, LRU, last block evicted first). Swapping out does not
register anything. The runner must follow the copy ordering rule of :mod:`.types`.

Sliding-window reclaim (``reclaim_window``, every attention layer windowed): each :meth:`allocate` first
gives back the blocks no query of the step reads (:mod:`.window_reclaim`), registering full committed ones
first; their entries become scratch-mapped holes, never swapped or matched.

Layer groups (``groups``, :mod:`.layer_groups`, :mod:`.kv_group`): one page map per group and request over
the one pool; every operation runs on every group (all or nothing). Group 0 anchors prefix retention, the
others attach their blocks to its entries (:mod:`.attached_blocks`); the runner reads group ``g``'s tables
for the layers of group ``g`` (:meth:`group_block_tables`).

KV tiers (``tiers``, :mod:`.prefix_tiers`): evicted retained blocks are copied to a host tier first, a
prompt whose chain goes on there is loaded back before the match (copies: :meth:`take_tier_moves`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tgi_paged_backend.memory import swap_moves
from tgi_paged_backend.memory.attached_blocks import AttachedBlocks
from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.block_table import BlockTableArray
from tgi_paged_backend.memory.invariants import check_manager_invariants
from tgi_paged_backend.memory.kv_group import KVGroup, cut_hit, group_windows
from tgi_paged_backend.memory.page_map import PageMap
from tgi_paged_backend.memory.prefix_cache import NullPrefixCache, PrefixCache, RegistryObserver, chain_root
from tgi_paged_backend.memory.prefix_tiers import TierMove, TierSetup, build_tiers
from tgi_paged_backend.memory.stats import MemoryStats, pool_stats
from tgi_paged_backend.memory.swap_space import SwapSpace
from tgi_paged_backend.memory.types import (
    EMPTY_ALLOCATION,
    NO_MATCH,
    Allocation,
    BlockCopy,
    PrefixMatch,
    RequestMemory,
    SwapPlan,
)


class KVCacheManager:
    """Page maps of live requests over one physical pool, with retention and swap space.

    Args:
        num_blocks: Physical blocks including the scratch block 0.
        block_size: Tokens per block.
        num_swap_blocks: CPU swap blocks (0 disables swapping).
        enable_prefix_retention: Keep full blocks of finished requests for content-verified reuse.
        observer: Told of every block the prefix cache registers and drops (the KV-events publisher;
            the first group's registry).
        reclaim_window: The sliding window of *every* attention layer, in tokens; blocks wholly
            behind it are given back as decoding moves on. ``None``: keep the whole history.
        groups: Instead of ``reclaim_window``: each layer group's window (``None``: full attention), one
            page map per group and request (:mod:`.layer_groups`).
        tiers: A host tier below the pool for evicted prefix blocks (:mod:`.prefix_tiers`; needs retention).
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        num_swap_blocks: int = 0,
        enable_prefix_retention: bool = True,
        observer: RegistryObserver | None = None,
        reclaim_window: int | None = None,
        groups: Sequence[int | None] | None = None,
        tiers: TierSetup | None = None,
    ) -> None:
        windows = group_windows(block_size, reclaim_window, groups)
        self.block_size = block_size
        self.reclaim_window = windows[0] if len(windows) == 1 else None
        self._num_reclaimed_total = 0
        self._pool = BlockPool(num_blocks)
        self._anchored = enable_prefix_retention and len(windows) > 1
        anchor: PrefixCache | NullPrefixCache = (
            PrefixCache(self._pool, block_size, observer, salt=tiers.salt if tiers else None)
            if enable_prefix_retention
            else NullPrefixCache(self._pool, block_size)
        )

        def registry(g: int) -> PrefixCache | NullPrefixCache | AttachedBlocks:
            if g == 0:
                return anchor
            if self._anchored and isinstance(anchor, PrefixCache):
                return AttachedBlocks(self._pool, anchor)
            return NullPrefixCache(self._pool, block_size)

        self._groups = [
            KVGroup(
                pool=self._pool,
                block_size=block_size,
                window=window,
                prefix=registry(g),
                table=BlockTableArray(block_size),
                tracks_serials=self._anchored and g == 0,
            )
            for g, window in enumerate(windows)
        ]
        if isinstance(anchor, PrefixCache) and self._anchored:
            anchor.on_forget = self._forget_serial
        self._pool.on_evict = self._forget_block
        self.tiers = build_tiers(tiers, self._pool, [g.prefix for g in self._groups], block_size)
        """The host tier below the pool (``None``: off); the engine asks it what the disk tier may add."""
        self._swap = SwapSpace(num_swap_blocks)
        first = self._groups[0]
        self._prefix, self._table, self._requests = first.prefix, first.table, first.requests  # group 0's
        self._num_prefix_query_tokens = 0
        self._num_prefix_hit_tokens = 0
        self._rows_cache: tuple[list[int], np.ndarray] | None = None

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self._groups)

    def _maps(self, request_id: int) -> list[PageMap]:
        return [g.requests[request_id] for g in self._groups]

    def _forget_block(self, block_id: int) -> None:
        """The pool evicted a retained block: the host tier keeps it, the registry that knows it forgets it."""
        if self.tiers is not None:
            self.tiers.pool_evicting(block_id)
        for group in self._groups:
            if group.prefix.is_registered(block_id):
                group.prefix.forget_block(block_id)
                return

    def _forget_serial(self, serial: int) -> None:
        """The anchor dropped an entry: the blocks other groups attached to it go too."""
        for group in self._groups[1:]:
            assert isinstance(group.prefix, AttachedBlocks)
            group.prefix.forget_serial(serial)

    def _anchor_serials(self, maps: Sequence[PageMap]) -> list[int]:
        """Register the anchor's full committed blocks (several groups with retention), and return its
        entries for the other groups to attach to; ``[]`` otherwise."""
        if not self._anchored:
            return []
        if maps[0].swapped is None:
            self._groups[0].register(maps[0])
        return maps[0].serials

    # ------------------------------------------------------------------------------- lifecycle
    def add_request(
        self, request_id: int, virtual_blocks: Sequence[int] = (), namespace: int = 0, extra: int = 0
    ) -> None:
        """Register a request; ``virtual_blocks``: the router's blocks (empty: self-managed), ``extra``: more to map.

        ``namespace``: the request's LoRA adapter index (0: the base model); prefix blocks are matched and
        registered only within it (:func:`.prefix_cache.chain_root`)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already registered")
        virtual = tuple(int(b) for b in virtual_blocks)
        if len(set(virtual)) != len(virtual):
            raise ValueError(f"request {request_id}: duplicate virtual blocks {virtual}")
        row = self._groups[0].table.add_row()  # every group's table holds the request at the same row
        for group in self._groups:
            table_row = row if group is self._groups[0] else group.table.add_row(row)
            group.requests[request_id] = PageMap.create(table_row, virtual, chain_root(namespace))
            group.requests[request_id].extra_blocks = extra
        self._rows_cache = None

    def match_prefix(self, request_id: int, prompt_ids: Sequence[int]) -> PrefixMatch:
        """Share retained blocks matching the leading tokens of ``prompt_ids`` (content decides; the host
        tier's continuation is loaded first). With several groups the hit is the anchor's, cut until every
        group has the blocks the hit point needs (:func:`.kv_group.cut_hit`). Call once after
        :meth:`add_request` (or :meth:`preempt_recompute`, with the full history), before :meth:`allocate`.
        """
        maps = self._maps(request_id)
        for req in maps:
            assert not req.blocks and req.swapped is None and req.cow_src is None, "request already has blocks"
            req.token_ids = [int(t) for t in prompt_ids]
            req.num_committed = req.num_allocated_tokens = 0
        self._num_prefix_query_tokens += len(prompt_ids)
        if self.tiers is not None:
            self.tiers.promote(maps[0].token_ids, maps[0].chain_root, maps[0].max_mappable_blocks)
        # never past the reservation or onto virtual block 0
        cut = cut_hit(self._groups, self._groups[0].match(maps[0]), maps[0].max_mappable_blocks)
        if cut is None:
            return NO_MATCH
        for group, req, (blocks, cow_src) in zip(self._groups, maps, cut.parts):
            group.share(req, blocks, cow_src, cut.num_cow_tokens)
        num_cached = maps[0].num_committed
        self._num_prefix_hit_tokens += num_cached
        return PrefixMatch(num_cached, len(cut.parts[0][0]), cut.parts[0][1], cut.num_cow_tokens)

    def allocate(self, request_id: int, num_tokens: int) -> Allocation | None:
        """Back token positions ``[0, num_tokens)`` with physical blocks in every group, all or nothing.

        Retained blocks are reclaimed (LRU) before giving up. With a window, the blocks no query of this
        step reads are given back first: the step's first query is the first position not asked for
        before (positions are written in order), so the engine needs no extra call. That release stands
        even when the allocation then fails (no later step reads them either).

        Returns:
            The new blocks and pending copy-on-write copies, or ``None`` when the pool is exhausted.

        Raises:
            ValueError: ``num_tokens`` exceeds the router's reservation for this request.
        """
        maps = self._maps(request_id)
        serials = self._anchor_serials(maps)
        for group, req in zip(self._groups, maps):
            self._num_reclaimed_total += group.release_outside_window(req, num_tokens, serials)
        first = maps[0]
        num_want = -(-num_tokens // self.block_size)
        if num_want <= len(first.blocks):
            for req in maps:
                if num_tokens > req.num_allocated_tokens:
                    req.num_allocated_tokens = num_tokens
            return EMPTY_ALLOCATION
        assert first.swapped is None, f"request {request_id} is swapped out"
        if first.virtual_blocks and num_want > len(first.virtual_blocks) + first.extra_blocks:
            raise ValueError(
                f"request {request_id}: {num_tokens} tokens exceed its {len(first.virtual_blocks)} router blocks"
            )
        fresh = [req.num_fresh_blocks(num_want) for req in maps]
        if sum(fresh) > self._pool.num_available_blocks:
            return None
        new_blocks: list[int] = []
        copies: list[BlockCopy] = []
        for group, req, num in zip(self._groups, maps, fresh):
            new = self._pool.allocate(num)
            assert new is not None, "the pool had the blocks a moment ago"
            copies.extend(group.map_new(req, new, num_want))
            req.num_allocated_tokens = num_tokens
            new_blocks.extend(new)
        return Allocation(tuple(new_blocks), tuple(copies))

    def blocks_needed(self, request_id: int, num_tokens: int) -> int:
        """Available blocks :meth:`allocate` would draw for ``num_tokens`` (0 if already backed): the
        fresh blocks of every group, less those the groups' window reclaim gives back first."""
        num_want = -(-num_tokens // self.block_size)
        maps = self._maps(request_id)
        fresh = sum(req.num_fresh_blocks(num_want) for req in maps)
        if fresh == 0:
            return 0
        returned = sum(group.blocks_returned(req, num_tokens) for group, req in zip(self._groups, maps))
        return max(fresh - returned, 0)

    def commit_tokens(self, request_id: int, token_ids: Sequence[int], start: int = 0) -> None:
        """Record that K/V of positions ``[0, start + len(token_ids))`` is written, ``token_ids`` being
        the tokens at ``start..`` (positions before ``start`` are already known: committed or matched).

        Prompt and generated tokens alike: full blocks of either are what retention registers."""
        for req in self._maps(request_id):
            num = start + len(token_ids)
            if num > len(req.blocks) * self.block_size:
                raise ValueError(
                    f"request {request_id}: {num} tokens committed but only "
                    f"{len(req.blocks) * self.block_size} positions are backed"
                )
            have = len(req.token_ids)
            if start > have:
                raise ValueError(
                    f"request {request_id}: tokens from position {start} committed, but only {have} are known"
                )
            if num > have:
                assert have == start or int(token_ids[have - start - 1]) == req.token_ids[have - 1], "history rewritten"
                req.token_ids.extend(int(t) for t in token_ids[have - start :])
            req.num_committed = num

    def truncate(self, request_id: int, num_tokens: int) -> int:
        """Forget positions from ``num_tokens`` on (rejected speculative tokens): blocks wholly past them go
        back to the pool (they hold no committed token, so none is retained); returns how many."""
        return sum(group.truncate(req, num_tokens) for group, req in zip(self._groups, self._maps(request_id)))

    def free(self, request_id: int) -> None:
        """Release everything of a finished (or filtered/cleared) request; full blocks are retained."""
        self._rows_cache = None
        maps = self._maps(request_id)
        serials = self._anchor_serials(maps)
        if maps[0].swapped is not None:
            swap_moves.release_swapped(maps, self._swap, self.tiers)
        for group, req in zip(self._groups, maps):
            del group.requests[request_id]
            if req.swapped is None:
                group.release_device_blocks(req, register=True, anchor_serials=serials)
            group.table.release_row(req.row)

    # ------------------------------------------------------------------------------ preemption
    def preempt_recompute(self, request_id: int) -> int:
        """Drop a resident request's blocks (full ones are retained); returns the tokens lost.

        The request stays registered and resumes with :meth:`match_prefix` and :meth:`allocate`.
        """
        maps = self._maps(request_id)
        lost = maps[0].num_committed
        serials = self._anchor_serials(maps)
        for group, req in zip(self._groups, maps):
            assert req.swapped is None, f"request {request_id} is swapped out"
            group.release_device_blocks(req, register=True, anchor_serials=serials)
        for req in maps:
            req.num_committed = req.num_allocated_tokens = req.num_holes = 0
            req.chain = req.chain_root
            req.serials = []
        return lost

    def can_swap_out(self, request_id: int) -> bool:
        """Whether :meth:`swap_out` would succeed now (resident, has blocks, swap space has room)."""
        return swap_moves.can_swap_out(self._maps(request_id), self._swap, self.tiers)

    def swap_out(self, request_id: int) -> SwapPlan | None:
        """Move a resident request's blocks (every group's, holes excluded) to CPU swap space, leaving
        those the host tier holds there (:mod:`.swap_moves`); ``None`` when there is no room."""
        if not self.can_swap_out(request_id):
            return None
        return SwapPlan(
            request_id, "out", *swap_moves.swap_out(self._groups, self._maps(request_id), self._swap, self.tiers)
        )

    def swap_in(self, request_id: int) -> SwapPlan | None:
        """Bring a swapped-out request back to the device (blocks left in the host tier come back as its
        ``load`` moves); ``None`` when the pool lacks room."""
        moves = swap_moves.swap_in(self._groups, self._maps(request_id), self._swap, self._pool, self.tiers)
        return None if moves is None else SwapPlan(request_id, "in", *moves)

    def take_tier_moves(self) -> list[TierMove]:
        """Host-tier copies issued since the last call, in issue order (run before later-issued copies)."""
        return self.tiers.take_moves() if self.tiers is not None else []

    # ------------------------------------------------------------------------ runner metadata
    def block_tables(self, request_ids: Sequence[int]) -> np.ndarray:
        """``int32 [len(request_ids), max_blocks]`` physical ids in token order, 0-padded (group 0)."""
        return self._table.gather(self._rows(request_ids))

    def group_block_tables(self, request_ids: Sequence[int]) -> list[np.ndarray]:
        """:meth:`block_tables` of every group, in group order."""
        rows = self._rows(request_ids)
        return [group.table.gather(rows) for group in self._groups]

    def slot_mapping(
        self, request_ids: Sequence[int], start_positions: Sequence[int], num_tokens: Sequence[int], group: int = 0
    ) -> np.ndarray:
        """``int64`` physical slots of positions ``[start, start + n)`` per request, concatenated."""
        return self._groups[group].table.chunk_slots(self._rows(request_ids), start_positions, num_tokens)

    def decode_slot_mapping(
        self, request_ids: Sequence[int], positions: Sequence[int] | np.ndarray, group: int = 0
    ) -> np.ndarray:
        """``int64`` physical slot of one token position per request."""
        return self._groups[group].table.slots(self._rows(request_ids), np.asarray(positions, dtype=np.int64))

    def virtual_to_physical_slots(self, request_id: int, router_slots: np.ndarray, group: int = 0) -> np.ndarray:
        """Translate router slots (``virtual_block * block_size + offset``) to physical slots.

        Virtual block 0 goes to the scratch block. Raises ``ValueError`` for a slot outside the
        request's virtual blocks or one whose block is not backed yet.
        """
        books = self._groups[group]
        try:
            return books.virtual_to_physical_slots(books.requests[request_id], router_slots)
        except ValueError as e:
            raise ValueError(f"request {request_id}: {e}") from None

    def _rows(self, request_ids: Sequence[int]) -> np.ndarray:
        """Block-table rows of ``request_ids`` (the same row in every group's table); the last answer is
        reused while the batch and the set of live requests are unchanged (the common decode case)."""
        ids = request_ids if isinstance(request_ids, list) else list(request_ids)
        if self._rows_cache is not None and self._rows_cache[0] == ids:
            return self._rows_cache[1]
        requests = self._requests
        rows = np.array([requests[r].row for r in ids], dtype=np.intp)
        self._rows_cache = (list(ids), rows)
        return rows

    # --------------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._pool.num_used_blocks

    @property
    def num_retained_blocks(self) -> int:
        return self._pool.num_retained_blocks

    @property
    def num_available_blocks(self) -> int:
        """Free plus reclaimable retained blocks (what allocations can draw on)."""
        return self._pool.num_available_blocks

    @property
    def num_swapped_blocks(self) -> int:
        return self._swap.num_used_blocks

    @property
    def num_free_swap_blocks(self) -> int:
        return self._swap.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """Usable physical blocks (the scratch block excluded)."""
        return self._pool.num_usable_blocks

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._requests

    def request_memory(self, request_id: int) -> RequestMemory:
        """Footprint of one request over every group (for victim choice and cost estimates)."""
        maps = self._maps(request_id)
        if maps[0].swapped is not None:
            return RequestMemory(sum(r.num_swapped_blocks for r in maps), 0, maps[0].num_committed, True)
        exclusive = sum(group.exclusive_blocks(req) for group, req in zip(self._groups, maps))
        return RequestMemory(sum(r.num_physical_blocks for r in maps), exclusive, maps[0].num_committed, False)

    def reset_prefix_cache(self) -> int:
        """Evict every retained block; returns how many were freed."""
        return self._pool.evict_all_retained()

    def stats(self, num_pending_blocks: int = 0) -> MemoryStats:
        """Occupancy and waste now (summed over groups); ``num_pending_blocks`` is the head-of-line
        allocation's need."""
        return pool_stats(
            pool=self._pool,
            swap=self._swap,
            groups=[(g.window, g.requests.values()) for g in self._groups],
            block_size=self.block_size,
            num_pending_blocks=num_pending_blocks,
            num_prefix_query_tokens=self._num_prefix_query_tokens,
            num_prefix_hit_tokens=self._num_prefix_hit_tokens,
            num_reclaimed_blocks_total=self._num_reclaimed_total,
        )

    # ------------------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Pool, prefix registries, swap space and every page map agree; refcount == number of holders."""
        check_manager_invariants(pool=self._pool, groups=self._groups, swap=self._swap, block_size=self.block_size)
        if self.tiers is not None:
            self.tiers.host.check_invariants()
