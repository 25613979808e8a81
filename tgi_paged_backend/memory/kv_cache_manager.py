"""The memory manager the engine uses: page maps, lazy physical blocks, prefix reuse, swap, waste.

Each request owns a :class:`~.page_map.PageMap`; physical blocks are mapped lazily, as a prefix of
it. A request is *resident* (its blocks are on the device -- possibly none yet, or none after a
recompute preemption) or *swapped* (its blocks are in CPU swap space) until :meth:`free`.

Retention: when a request frees (or is preempted for recompute), its full committed blocks --
prompt *and* generated tokens, since a chat follow-up re-sends both -- are registered in the prefix
cache and become retained (reclaimable, LRU, last block evicted first). Swapping out does not
register anything. The runner must follow the copy ordering rule of :mod:`.types`.

Sliding-window reclaim (``reclaim_window``, set when every attention layer is windowed): each
:meth:`allocate` first gives back the request's blocks that no query of the step reads
(:mod:`.window_reclaim`); their entries become scratch-mapped holes. Full committed blocks are
registered just before they go (so they are retained, and the chain goes on past the holes from
``PageMap.chain``). Holes are never swapped or matched; a recompute preemption starts afresh.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.block_table import BlockTableArray
from tgi_paged_backend.memory.invariants import check_manager_invariants
from tgi_paged_backend.memory.page_map import PageMap
from tgi_paged_backend.memory.prefix_cache import NullPrefixCache, PrefixCache, RegistryObserver, chain_root
from tgi_paged_backend.memory.stats import MemoryStats, stranded_blocks, summarize_waste
from tgi_paged_backend.memory.swap_space import SwapSpace
from tgi_paged_backend.memory.types import (
    EMPTY_ALLOCATION,
    NO_MATCH,
    SCRATCH_BLOCK,
    Allocation,
    BlockCopy,
    PrefixMatch,
    RequestMemory,
    SwapPlan,
)
from tgi_paged_backend.memory.window_reclaim import num_blocks_outside_window, release_blocks_outside_window


class KVCacheManager:
    """Page maps of live requests over one physical pool, with retention and swap space.

    Args:
        num_blocks: Physical blocks including the scratch block 0.
        block_size: Tokens per block.
        num_swap_blocks: CPU swap blocks (0 disables swapping).
        enable_prefix_retention: Keep full blocks of finished requests for content-verified reuse.
        observer: Told of every block the prefix cache registers and drops (the KV-events publisher).
        reclaim_window: The sliding window of *every* attention layer, in tokens; blocks wholly
            behind it are given back as decoding moves on. ``None``: keep the whole history.
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
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: allowed >= 1")
        if reclaim_window is not None and reclaim_window < 1:
            raise ValueError(f"reclaim_window={reclaim_window} is invalid: allowed >= 1 or None")
        self.block_size = block_size
        self.reclaim_window = reclaim_window
        self._num_reclaimed_total = 0
        self._pool = BlockPool(num_blocks)
        self._prefix: PrefixCache | NullPrefixCache = (
            PrefixCache(self._pool, block_size, observer)
            if enable_prefix_retention
            else NullPrefixCache(self._pool, block_size)
        )
        self._pool.on_evict = self._prefix.forget_block
        self._swap = SwapSpace(num_swap_blocks)
        self._table = BlockTableArray(block_size)
        self._requests: dict[int, PageMap] = {}
        self._num_prefix_query_tokens = 0
        self._num_prefix_hit_tokens = 0
        self._rows_cache: tuple[list[int], np.ndarray] | None = None

    # ------------------------------------------------------------------------------- lifecycle
    def add_request(self, request_id: int, virtual_blocks: Sequence[int] = (), namespace: int = 0) -> None:
        """Register a request; ``virtual_blocks`` are the router's blocks (empty: self-managed).

        ``namespace``: the request's LoRA adapter index (0: the base model); prefix blocks are matched and
        registered only within it (:func:`.prefix_cache.chain_root`)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already registered")
        virtual = tuple(int(b) for b in virtual_blocks)
        if len(set(virtual)) != len(virtual):
            raise ValueError(f"request {request_id}: duplicate virtual blocks {virtual}")
        self._requests[request_id] = PageMap.create(self._table.add_row(), virtual, chain_root(namespace))
        self._rows_cache = None

    def match_prefix(self, request_id: int, prompt_ids: Sequence[int]) -> PrefixMatch:
        """Share retained blocks matching the leading tokens of ``prompt_ids`` (content decides).

        Call once after :meth:`add_request` (or after :meth:`preempt_recompute`, with the full token
        history), before the first :meth:`allocate`.
        """
        req = self._requests[request_id]
        assert not req.blocks and req.swapped is None and req.cow_src is None, "request already has blocks"
        req.token_ids = [int(t) for t in prompt_ids]
        req.num_committed = req.num_allocated_tokens = 0
        self._num_prefix_query_tokens += len(req.token_ids)
        hit = self._prefix.match(req.token_ids, req.chain_root)
        shared, cow_src = hit.block_ids, hit.cow_src
        limit = req.max_mappable_blocks  # never past the reservation or onto virtual block 0
        if limit is not None and len(shared) >= limit:
            shared, cow_src = shared[:limit], None
        if not shared and cow_src is None:
            return NO_MATCH
        for block_id in shared:
            self._pool.incref(block_id)
        req.blocks = list(shared)
        self._table.append(req.row, shared)
        num_cow = 0
        if cow_src is not None:
            self._pool.incref(cow_src)
            req.cow_src, req.num_cow_tokens = cow_src, hit.num_cow_tokens
            num_cow = hit.num_cow_tokens
        req.num_committed = req.num_allocated_tokens = len(shared) * self.block_size + num_cow
        self._num_prefix_hit_tokens += req.num_committed
        return PrefixMatch(req.num_committed, len(shared), cow_src, num_cow)

    def allocate(self, request_id: int, num_tokens: int) -> Allocation | None:
        """Back token positions ``[0, num_tokens)`` with physical blocks, all or nothing.

        Retained blocks are reclaimed (LRU) before giving up. With a reclaim window, the blocks no
        query of this step reads are given back first: the step's first query is the first position
        not asked for before (positions are written in order), so the engine needs no extra call.
        That release stands even when the allocation then fails (no later step reads them either).

        Returns:
            The new blocks and pending copy-on-write copies, or ``None`` when the pool is exhausted.

        Raises:
            ValueError: ``num_tokens`` exceeds the router's reservation for this request.
        """
        req = self._requests[request_id]
        if self.reclaim_window is not None and (end := self._num_outside_window(req, num_tokens)) > req.num_holes:
            self._register(req)  # what leaves is retained, and the chain stays whole
            self._num_reclaimed_total += release_blocks_outside_window(
                req, end, pool=self._pool, table=self._table, is_registered=self._prefix.is_registered
            )
        num_have = len(req.blocks)
        num_want = -(-num_tokens // self.block_size)
        if num_want <= num_have:
            if num_tokens > req.num_allocated_tokens:
                req.num_allocated_tokens = num_tokens
            return EMPTY_ALLOCATION
        assert req.swapped is None, f"request {request_id} is swapped out"
        if req.virtual_blocks and num_want > len(req.virtual_blocks):
            raise ValueError(
                f"request {request_id}: {num_tokens} tokens exceed its {len(req.virtual_blocks)} router blocks"
            )
        new = self._pool.allocate(req.num_fresh_blocks(num_want))
        if new is None:
            return None
        mapped = req.extension(new, num_want)
        copies: tuple[BlockCopy, ...] = ()
        if req.cow_src is not None:
            assert mapped[0] != SCRATCH_BLOCK
            copies = (BlockCopy(req.cow_src, mapped[0], req.num_cow_tokens),)
            self._release_cow_source(req)
        req.blocks.extend(mapped)
        req.num_allocated_tokens = num_tokens
        self._table.append(req.row, mapped)
        return Allocation(tuple(new), copies)

    def blocks_needed(self, request_id: int, num_tokens: int) -> int:
        """Available blocks :meth:`allocate` would draw for ``num_tokens`` (0 if already backed): the
        fresh blocks, less those its window reclaim gives back to the available blocks first."""
        req = self._requests[request_id]
        fresh = req.num_fresh_blocks(-(-num_tokens // self.block_size))
        if self.reclaim_window is None or fresh == 0:
            return fresh
        returned = sum(
            1
            for b in req.blocks[req.num_holes : self._num_outside_window(req, num_tokens)]
            if b != SCRATCH_BLOCK and self._pool.refcount(b) == 1
        )
        return max(fresh - returned, 0)

    def commit_tokens(self, request_id: int, token_ids: Sequence[int], start: int = 0) -> None:
        """Record that K/V of positions ``[0, start + len(token_ids))`` is written, ``token_ids`` being
        the tokens at ``start..`` (positions before ``start`` are already known: committed or matched).

        Prompt and generated tokens alike: full blocks of either are what retention registers."""
        req = self._requests[request_id]
        num = start + len(token_ids)
        if num > len(req.blocks) * self.block_size:
            raise ValueError(
                f"request {request_id}: {num} tokens committed but only "
                f"{len(req.blocks) * self.block_size} positions are backed"
            )
        have = len(req.token_ids)
        if start > have:
            raise ValueError(f"request {request_id}: tokens from position {start} committed, but only {have} are known")
        if num > have:
            assert have == start or int(token_ids[have - start - 1]) == req.token_ids[have - 1], "history rewritten"
            req.token_ids.extend(int(t) for t in token_ids[have - start :])
        req.num_committed = num

    def truncate(self, request_id: int, num_tokens: int) -> int:
        """Forget positions from ``num_tokens`` on (rejected speculative tokens): blocks wholly past them go
        back to the pool (they hold no committed token, so none is retained); returns how many."""
        req = self._requests[request_id]
        assert req.swapped is None, f"request {request_id} is swapped out"
        keep = max(-(-num_tokens // self.block_size), req.num_holes)
        dropped = req.blocks[keep:]
        req.num_committed = min(req.num_committed, num_tokens)
        req.num_allocated_tokens = min(req.num_allocated_tokens, num_tokens)
        del req.token_ids[num_tokens:]
        if not dropped:
            return 0
        assert req.cow_src is None, f"request {request_id}: a pending copy-on-write past its history"
        for block_id in reversed(dropped):
            if block_id != SCRATCH_BLOCK:
                assert not self._prefix.is_registered(block_id), "a retained block past the committed tokens"
                self._pool.decref(block_id, retain=False)
        del req.blocks[keep:]
        self._table.truncate(req.row, keep)
        return len(dropped)

    def free(self, request_id: int) -> None:
        """Release everything of a finished (or filtered/cleared) request; full blocks are retained."""
        req = self._requests.pop(request_id)
        self._rows_cache = None
        if req.swapped is not None:
            self._swap.free(req.swapped)
        else:
            self._release_device_blocks(req, register=True)
        self._table.release_row(req.row)

    # ------------------------------------------------------------------------------ preemption
    def preempt_recompute(self, request_id: int) -> int:
        """Drop a resident request's blocks (full ones are retained); returns the tokens lost.

        The request stays registered and resumes with :meth:`match_prefix` and :meth:`allocate`.
        """
        req = self._requests[request_id]
        assert req.swapped is None, f"request {request_id} is swapped out"
        lost = req.num_committed
        self._release_device_blocks(req, register=True)
        req.num_committed = req.num_allocated_tokens = req.num_holes = 0
        req.chain = req.chain_root
        return lost

    def can_swap_out(self, request_id: int) -> bool:
        """Whether :meth:`swap_out` would succeed now (resident, has blocks, swap space has room)."""
        req = self._requests[request_id]
        if req.swapped is not None or req.cow_src is not None:
            return False
        num = req.num_physical_blocks
        return num > 0 and self._swap.can_allocate(num)

    def swap_out(self, request_id: int) -> SwapPlan | None:
        """Move a resident request's blocks to CPU swap space; ``None`` when there is no room."""
        if not self.can_swap_out(request_id):
            return None
        req = self._requests[request_id]
        src = [b for b in req.blocks if b != SCRATCH_BLOCK]
        dst = self._swap.allocate(len(src))
        assert dst is not None
        req.num_swapped_positions = len(req.blocks)
        self._release_device_blocks(req, register=False)
        req.swapped = dst
        return SwapPlan(request_id, "out", tuple(src), tuple(dst))

    def swap_in(self, request_id: int) -> SwapPlan | None:
        """Bring a swapped-out request back to the device; ``None`` when the pool lacks room."""
        req = self._requests[request_id]
        assert req.swapped is not None, f"request {request_id} is not swapped out"
        dst = self._pool.allocate(len(req.swapped))
        if dst is None:
            return None
        src = req.swapped
        self._swap.free(src)
        req.swapped = None
        req.blocks = [SCRATCH_BLOCK] * req.num_holes  # holes were not swapped: they come back as holes
        req.blocks.extend(req.extension(dst, req.num_swapped_positions))
        self._table.append(req.row, req.blocks)
        return SwapPlan(request_id, "in", tuple(src), tuple(dst))

    # ------------------------------------------------------------------------ runner metadata
    def block_tables(self, request_ids: Sequence[int]) -> np.ndarray:
        """``int32 [len(request_ids), max_blocks]`` physical ids in token order, 0-padded."""
        return self._table.gather(self._rows(request_ids))

    def slot_mapping(
        self, request_ids: Sequence[int], start_positions: Sequence[int], num_tokens: Sequence[int]
    ) -> np.ndarray:
        """``int64`` physical slots of positions ``[start, start + n)`` per request, concatenated."""
        rows = self._rows(request_ids)
        starts = np.asarray(start_positions, dtype=np.int64)
        counts = np.asarray(num_tokens, dtype=np.int64)
        total = int(counts.sum())
        first = np.cumsum(counts) - counts
        positions = np.repeat(starts - first, counts) + np.arange(total, dtype=np.int64)
        return self._table.slots(np.repeat(rows, counts), positions)

    def decode_slot_mapping(self, request_ids: Sequence[int], positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """``int64`` physical slot of one token position per request."""
        return self._table.slots(self._rows(request_ids), np.asarray(positions, dtype=np.int64))

    def virtual_to_physical_slots(self, request_id: int, router_slots: np.ndarray) -> np.ndarray:
        """Translate router slots (``virtual_block * block_size + offset``) to physical slots.

        Virtual block 0 goes to the scratch block. Raises ``ValueError`` for a slot outside the
        request's virtual blocks or one whose block is not backed yet.
        """
        req = self._requests[request_id]
        slots = np.asarray(router_slots, dtype=np.int64)
        virtual, offset = np.divmod(slots, self.block_size)
        physical = np.zeros_like(virtual)
        real = virtual != SCRATCH_BLOCK
        if real.any():
            index = req.virtual_block_indices(virtual[real])
            if (index >= len(req.blocks)).any():
                raise ValueError(f"request {request_id}: router slot in a block not backed yet")
            physical[real] = self._table.table[req.row, index]
        return physical * self.block_size + offset

    def _rows(self, request_ids: Sequence[int]) -> np.ndarray:
        """Block-table rows of ``request_ids``; the last answer is reused while the batch and the
        set of live requests are unchanged (the common decode case: tables + slots, step after step)."""
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
        """Footprint of one request (for victim choice and cost estimates)."""
        req = self._requests[request_id]
        if req.swapped is not None:
            return RequestMemory(len(req.swapped), 0, req.num_committed, True)
        exclusive = sum(1 for b in req.blocks if b != SCRATCH_BLOCK and self._pool.refcount(b) == 1)
        return RequestMemory(req.num_physical_blocks, exclusive, req.num_committed, False)

    def reset_prefix_cache(self) -> int:
        """Evict every retained block; returns how many were freed."""
        return self._pool.evict_all_retained()

    def stats(self, num_pending_blocks: int = 0) -> MemoryStats:
        """Occupancy and waste now; ``num_pending_blocks`` is the head-of-line allocation's need."""
        waste = summarize_waste(self._requests.values(), self.block_size)
        return MemoryStats(
            block_size=self.block_size,
            num_total_blocks=self.num_total_blocks,
            num_free_blocks=self.num_free_blocks,
            num_used_blocks=self.num_used_blocks,
            num_retained_blocks=self.num_retained_blocks,
            num_swapped_blocks=self.num_swapped_blocks,
            num_swap_total_blocks=self._swap.num_blocks,
            num_requests=len(self._requests),
            num_swapped_requests=waste.num_swapped_requests,
            num_written_tokens=waste.num_written_tokens,
            num_reserved_slots=waste.num_reserved_slots,
            internal_waste_slots=waste.internal_slots,
            reservation_waste_slots=waste.reservation_slots,
            external_waste_blocks=stranded_blocks(self.num_available_blocks, num_pending_blocks),
            num_prefix_query_tokens=self._num_prefix_query_tokens,
            num_prefix_hit_tokens=self._num_prefix_hit_tokens,
            num_hole_blocks=waste.num_hole_blocks,
            num_reclaimed_blocks_total=self._num_reclaimed_total,
        )

    # ------------------------------------------------------------------------------ internals
    def _num_outside_window(self, req: PageMap, num_tokens: int) -> int:
        """Leading page-map blocks no query of a step ending at ``num_tokens`` reads; the step's
        first query is the position after what the request asked for before."""
        assert self.reclaim_window is not None
        first_query = min(req.num_allocated_tokens, num_tokens - 1)
        return min(num_blocks_outside_window(first_query, self.reclaim_window, self.block_size), len(req.blocks))

    def _register(self, req: PageMap) -> None:
        """Register the full committed blocks: from the root, or past the holes from where the chain
        ended (it cannot restart behind them)."""
        num_written = min(req.num_committed, len(req.blocks) * self.block_size)
        start = req.chain if req.num_holes else req.chain_root
        req.chain = self._prefix.extend(req.token_ids, req.blocks, num_written, start)[0]

    def _release_cow_source(self, req: PageMap) -> None:
        assert req.cow_src is not None
        self._pool.decref(req.cow_src, retain=self._prefix.is_registered(req.cow_src))
        req.cow_src, req.num_cow_tokens = None, 0

    def _release_device_blocks(self, req: PageMap, *, register: bool) -> None:
        """Unpin a pending copy source, optionally register full written blocks, drop all blocks.

        Blocks are released last-first so that, once retained, a chain's tail is evicted before its
        head (a block is only reachable through its parents).
        """
        if req.cow_src is not None:
            self._release_cow_source(req)
        if register:
            self._register(req)
        is_registered = self._prefix.is_registered
        for block_id in reversed(req.blocks):
            if block_id != SCRATCH_BLOCK:
                self._pool.decref(block_id, retain=is_registered(block_id))
        req.blocks = []
        self._table.clear(req.row)

    # ------------------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Pool, prefix cache, swap space and every page map agree; refcount == number of holders."""
        check_manager_invariants(
            pool=self._pool,
            prefix=self._prefix,
            swap=self._swap,
            table=self._table,
            requests=self._requests,
            block_size=self.block_size,
            window=self.reclaim_window,
        )
