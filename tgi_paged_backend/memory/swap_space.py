"""CPU swap space: block ids of a host-memory pool with the device pool's block shape.

Only ids live here; the runner owns the pinned host tensors and moves the bytes. Blocks are not
shared or retained on the CPU side, so a plain free list suffices. Ids start at 0 (there is no
scratch block on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterable


class SwapSpace:
    """Free list of ``num_blocks`` CPU blocks (``num_blocks == 0`` disables swapping).

    Args:
        num_blocks: CPU blocks available for swapped-out requests.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_swap_blocks={num_blocks} is invalid: allowed >= 0")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` CPU blocks are free right now."""
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` CPU blocks, all or nothing; ``None`` when there is no room."""
        assert num_blocks >= 0
        if num_blocks > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(num_blocks)]
        self._used.update(taken)
        return taken

    def free(self, block_ids: Iterable[int]) -> None:
        """Return CPU blocks to the free list."""
        for block_id in block_ids:
            self._used.remove(block_id)
            self._free.append(block_id)

    def check_invariants(self) -> None:
        """Free and used partition ``range(num_blocks)``."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate CPU block on the free list"
        assert not free & self._used, "CPU block both free and used"
        assert free | self._used == set(range(self.num_blocks)), "a CPU block is lost"
