"""KV events of the disk tier (medium ``"DISK"``), published from the engine thread.

The disk store's writer thread never calls the publisher: it notes what it wrote and deleted
(:meth:`~tgi_paged_backend.offload.disk_store.DiskStore.take_changes`), and the engine hands those notes to
:class:`DiskTierEvents` after each step, before the step's batch of events is closed. A written file's
note carries the block the spill put (its chain hash names the block on the wire); a deleted file is
named by its key only, so the blocks announced here are remembered by key until their file goes. Files
an earlier process wrote were never announced, and their deletion is not either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tgi_paged_backend.memory.block_keys import TierBlock

if TYPE_CHECKING:
    from tgi_paged_backend.memory.prefix_tiers import TierObserver
    from tgi_paged_backend.offload.disk_store import DiskStore

DISK_MEDIUM = "DISK"


class DiskTierEvents:
    """Turns a disk store's changes into ``tier_stored`` / ``tier_removed`` calls with medium ``DISK``."""

    def __init__(self) -> None:
        self._announced: dict[bytes, TierBlock] = {}
        """Files announced as stored, by key: what a deletion names."""

    @property
    def num_announced(self) -> int:
        return len(self._announced)

    def publish(self, disk: DiskStore, observer: TierObserver) -> None:
        """Report what ``disk`` wrote and deleted since the last call, in the order it happened."""
        for written, key, block in disk.take_changes():
            if written:
                if isinstance(block, TierBlock) and key not in self._announced:
                    self._announced[key] = block
                    observer.tier_stored(DISK_MEDIUM, block)
            elif (gone := self._announced.pop(key, None)) is not None:
                observer.tier_removed(DISK_MEDIUM, gone)
