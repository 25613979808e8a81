"""The physical block pool: which device blocks are free, used (refcounted) or retained.

A physical block is one row of the KV pool tensors. Every block other than the scratch block is in
exactly one of three states:

- **free**: holds nothing of value; on the free list.
- **used**: ``refcount >= 1``; held by that many request mappings (shared prefix blocks have > 1).
- **retained**: ``refcount == 0`` but its contents are registered in the prefix cache and may be
  reused; reclaimable in least-recently-released order.

Physical block 0 is the *scratch* block (:data:`~tgi_paged_backend.memory.types.SCRATCH_BLOCK`): it
is never handed out and its refcount is not tracked; it backs router virtual block 0 (the liveness
probe) and the padding of block tables.

All operations are O(1) per block: the free list is a stack (LIFO reuse keeps recently touched
memory warm and makes ids predictable in tests), the retained set is an ``OrderedDict`` used as an
LRU queue (O(1) removal from the middle when a retained block is reused, unlike ``deque.remove``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from tgi_paged_backend.memory.types import SCRATCH_BLOCK


class BlockPool:
    """Free list, refcounts and the retained LRU queue of ``num_blocks`` physical blocks.

    Fresh pools hand out blocks in ascending id order (1, 2, 3, ...); released blocks are reused
    last-released-first. Retained blocks are evicted oldest-released first; each eviction is reported
    to ``on_evict`` (the prefix cache drops its entry for the block).

    Args:
        num_blocks: Physical blocks, including the scratch block (so ``num_blocks - 1`` usable).
        on_evict: Called with the block id whenever a retained block is reclaimed by :meth:`allocate`.
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} is invalid: need >= 2 (block 0 is scratch)")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        # Stack: pop() from the end; reversed so a fresh pool hands out 1, 2, 3, ...
        self._free: list[int] = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))
        self._refcount: list[int] = [0] * num_blocks
        # Oldest released first; values unused.
        self._retained: OrderedDict[int, None] = OrderedDict()
        self._num_used = 0

    # ----------------------------------------------------------------------------------- queries
    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_retained_blocks(self) -> int:
        return len(self._retained)

    @property
    def num_available_blocks(self) -> int:
        """Blocks :meth:`allocate` can hand out: free plus reclaimable retained."""
        return len(self._free) + len(self._retained)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def is_retained(self, block_id: int) -> bool:
        return block_id in self._retained

    def retained_lru(self) -> list[int]:
        """Retained blocks, next-to-evict first (for tests and debugging)."""
        return list(self._retained)

    def free_list(self) -> list[int]:
        """Free blocks, next-to-allocate first (for tests and debugging)."""
        return self._free[::-1]

    # --------------------------------------------------------------------------------- mutations
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks (refcount 1 each), all or nothing.

        Free blocks go first; then retained blocks are evicted, least recently released first.

        Returns:
            The block ids in allocation order, or ``None`` when free + retained blocks do not suffice
            (nothing is evicted in that case).
        """
        assert num_blocks >= 0
        if num_blocks > len(self._free) + len(self._retained):
            return None
        taken: list[int] = []
        free = self._free
        refcount = self._refcount
        while len(taken) < num_blocks and free:
            block_id = free.pop()
            refcount[block_id] = 1
            taken.append(block_id)
        while len(taken) < num_blocks:
            if free:  # an eviction may free more blocks (entries attached to the evicted one)
                block_id = free.pop()
            else:
                block_id, _ = self._retained.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(block_id)
            refcount[block_id] = 1
            taken.append(block_id)
        self._num_used += num_blocks
        return taken

    def incref(self, block_id: int) -> None:
        """Add a holder to a used or retained block (a retained block becomes used again)."""
        assert block_id != SCRATCH_BLOCK, "the scratch block is not refcounted"
        if self._refcount[block_id] == 0:
            assert block_id in self._retained, f"block {block_id} is free; cannot share it"
            del self._retained[block_id]
            self._num_used += 1
        self._refcount[block_id] += 1

    def decref(self, block_id: int, *, retain: bool) -> None:
        """Drop a holder; at refcount 0 the block becomes retained (``retain``) or free."""
        assert block_id != SCRATCH_BLOCK, "the scratch block is not refcounted"
        count = self._refcount[block_id]
        assert count > 0, f"block {block_id} released more often than held"
        self._refcount[block_id] = count - 1
        if count == 1:
            self._num_used -= 1
            if retain:
                self._retained[block_id] = None
            else:
                self._free.append(block_id)

    def decref_all(self, block_ids: Iterable[int], retain: Callable[[int], bool]) -> None:
        """:meth:`decref` each block in the given order, asking ``retain(block_id)`` per block."""
        for block_id in block_ids:
            self.decref(block_id, retain=retain(block_id))

    def discard_retained(self, block_id: int) -> None:
        """Move a retained block to the free list without calling ``on_evict`` (caller dropped it)."""
        del self._retained[block_id]
        self._free.append(block_id)

    def evict_all_retained(self, limit: int | None = None) -> int:
        """Evict every retained block (at most ``limit``), oldest first, calling ``on_evict``; returns how many."""
        count = 0
        while self._retained and (limit is None or count < limit):
            block_id, _ = self._retained.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block_id)
            self._free.append(block_id)
            count += 1
        return count

    # -------------------------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Free, used and retained partition the non-scratch blocks; refcounts agree with states."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate block on the free list"
        retained = set(self._retained)
        assert SCRATCH_BLOCK not in free and SCRATCH_BLOCK not in retained, "scratch block handed out"
        assert not free & retained, "block both free and retained"
        used = {b for b in range(1, self.num_blocks) if self._refcount[b] > 0}
        assert not used & (free | retained), "block with holders is free or retained"
        assert len(used) == self._num_used, "used-block counter drifted"
        assert len(free) + len(retained) + len(used) == self.num_blocks - 1, "a block is lost"
        assert all(count >= 0 for count in self._refcount), "negative refcount"
        assert self._refcount[SCRATCH_BLOCK] == 0
