"""A KV layer group's prefix registry keyed by the anchor group's entries.

With several KV layer groups (:mod:`.layer_groups`), group 0 is the *anchor*: its
:class:`~.prefix_cache.PrefixCache` hashes and verifies the token chains. Every other group keeps
only which of its blocks holds the same positions as an anchor entry (``anchor serial -> block``):
the anchor's verification covers it, since the same tokens under the same verified prefix give the
same K/V in every layer. A hit is then the anchor's hit, cut where some group lacks a block it needs;
a sliding group needs only the blocks its window reads at the hit point, so the blocks it gave back
long ago (the oldest in the LRU) may be evicted without shortening later hits.

When the anchor forgets an entry (evicted or stale), the attached blocks go with it: a retained one
goes free, one in use is simply no longer registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.types import SCRATCH_BLOCK

if TYPE_CHECKING:
    from tgi_paged_backend.memory.prefix_cache import PrefixCache


class AttachedBlocks:
    """One non-anchor group's blocks, registered under the anchor's entry serials."""

    def __init__(self, pool: BlockPool, anchor: PrefixCache) -> None:
        self._pool = pool
        self._anchor = anchor
        self._by_serial: dict[int, int] = {}
        self._by_block: dict[int, int] = {}

    @property
    def num_entries(self) -> int:
        return len(self._by_block)

    def is_registered(self, block_id: int) -> bool:
        return block_id in self._by_block

    def block_for(self, serial: int) -> int | None:
        """The group's block holding the positions of the anchor entry ``serial``, if any."""
        return self._by_serial.get(serial)

    def attach(self, blocks: Sequence[int], serials: Sequence[int], start: int) -> None:
        """Register ``blocks[i]`` under ``serials[i]`` for ``i`` from ``start`` on (scratch entries
        skipped; a serial that has a block already keeps it, and ``blocks[i]`` stays unregistered; so does
        one whose anchor entry is gone since the anchor's chain walked it)."""
        for index in range(start, min(len(blocks), len(serials))):
            block_id, serial = blocks[index], serials[index]
            if block_id == SCRATCH_BLOCK or serial in self._by_serial or block_id in self._by_block:
                continue
            if not self._anchor.has_serial(serial):
                continue
            self._by_serial[serial] = block_id
            self._by_block[block_id] = serial

    def forget_block(self, block_id: int) -> None:
        """The pool evicted ``block_id`` (retained): drop its entry."""
        del self._by_serial[self._by_block.pop(block_id)]

    def forget_serial(self, serial: int) -> None:
        """The anchor dropped entry ``serial``: its attached block goes too (free if retained)."""
        block_id = self._by_serial.pop(serial, None)
        if block_id is None:
            return
        del self._by_block[block_id]
        if self._pool.is_retained(block_id):
            self._pool.discard_retained(block_id)

    def check_invariants(self) -> None:
        """Both maps agree, every entry's anchor entry exists, attached blocks are used or retained."""
        assert len(self._by_serial) == len(self._by_block)
        for serial, block_id in self._by_serial.items():
            assert self._by_block[block_id] == serial and block_id != SCRATCH_BLOCK
            assert self._anchor.has_serial(serial), f"block {block_id} attached to a forgotten anchor entry {serial}"
            assert self._pool.refcount(block_id) > 0 or self._pool.is_retained(block_id), (
                f"attached block {block_id} is free"
            )
