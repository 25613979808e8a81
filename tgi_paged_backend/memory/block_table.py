"""Persistent block tables: one int32 row of physical block ids per live request.

The kernels read block tables as ``int32 [batch, max_blocks]``, padded with the scratch block (0).
Rebuilding that from Python lists each step costs O(batch x blocks) interpreter work; instead every
live request owns a row of one persistent array, updated incrementally when blocks are mapped, and a
step's tables and slot mappings are numpy fancy-indexing gathers over those rows.

Rows are recycled (a free-row stack); the array grows by doubling in both dimensions. Invariant: in
every row, columns at and past ``lengths[row]`` hold 0, and free rows are all 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tgi_paged_backend.memory.types import SCRATCH_BLOCK


class BlockTableArray:
    """Rows of physical block ids in token order, plus per-row lengths.

    Args:
        block_size: Tokens per block (for slot arithmetic).
        initial_rows: Rows allocated up front (grown by doubling).
        initial_cols: Columns allocated up front (grown by doubling).
    """

    def __init__(self, block_size: int, initial_rows: int = 64, initial_cols: int = 16) -> None:
        self.block_size = block_size
        self.table = np.zeros((initial_rows, initial_cols), dtype=np.int32)
        self.lengths = np.zeros(initial_rows, dtype=np.int32)
        self._free_rows: list[int] = list(range(initial_rows - 1, -1, -1))

    @property
    def num_live_rows(self) -> int:
        return self.table.shape[0] - len(self._free_rows)

    # ------------------------------------------------------------------------------ row upkeep
    def add_row(self, row: int | None = None) -> int:
        """Take an empty row (growing the array when none is free); ``row``: take exactly that one (the
        other KV layer groups take the row group 0 gave the request). ``ValueError`` when it is in use."""
        while not self._free_rows or (row is not None and row >= self.table.shape[0]):
            self._grow()
        if row is None:
            return self._free_rows.pop()
        try:
            self._free_rows.remove(row)
        except ValueError:
            raise ValueError(f"block-table row {row} is already in use") from None
        return row

    def _grow(self) -> None:
        rows, cols = self.table.shape
        table = np.zeros((2 * rows, cols), dtype=np.int32)
        table[:rows] = self.table
        lengths = np.zeros(2 * rows, dtype=np.int32)
        lengths[:rows] = self.lengths
        self.table, self.lengths = table, lengths
        self._free_rows = list(range(2 * rows - 1, rows - 1, -1)) + self._free_rows

    def release_row(self, row: int) -> None:
        """Give back a row (it is cleared first)."""
        self.clear(row)
        self._free_rows.append(row)

    def append(self, row: int, block_ids: Sequence[int]) -> None:
        """Map ``block_ids`` after the row's current blocks."""
        start = int(self.lengths[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            cols = self.table.shape[1]
            while cols < end:
                cols *= 2
            table = np.zeros((self.table.shape[0], cols), dtype=np.int32)
            table[:, : self.table.shape[1]] = self.table
            self.table = table
        self.table[row, start:end] = block_ids
        self.lengths[row] = end

    def unmap(self, row: int, start: int, end: int) -> None:
        """Point columns ``[start, end)`` of the row at the scratch block (holes; the length stays)."""
        self.table[row, start:end] = SCRATCH_BLOCK

    def truncate(self, row: int, length: int) -> None:
        """Keep the row's first ``length`` blocks (the rest unmapped)."""
        self.table[row, length : self.lengths[row]] = SCRATCH_BLOCK
        self.lengths[row] = min(int(self.lengths[row]), length)

    def clear(self, row: int) -> None:
        """Unmap every block of the row."""
        self.table[row, : self.lengths[row]] = SCRATCH_BLOCK
        self.lengths[row] = 0

    # ---------------------------------------------------------------------------------- gathers
    def gather(self, rows: np.ndarray) -> np.ndarray:
        """``int32 [len(rows), max_len]`` block tables, padded with the scratch block."""
        if len(rows) == 0:
            return np.zeros((0, 1), dtype=np.int32)
        width = max(int(self.lengths[rows].max()), 1)
        return self.table[rows, :width]

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``int64`` physical slots of one token position per row (``rows`` and ``positions`` align).

        Raises:
            ValueError: A position is negative or not backed by a mapped block.
        """
        bs = self.block_size
        block_index, offset = np.divmod(positions, bs)
        if (block_index >= self.lengths[rows]).any() or (block_index < 0).any():
            raise ValueError("slot requested for a token position without a physical block")
        slots = self.table.ravel().take(rows * self.table.shape[1] + block_index).astype(np.int64)
        slots *= bs
        slots += offset
        return slots

    def chunk_slots(self, rows: np.ndarray, starts: Sequence[int], counts: Sequence[int]) -> np.ndarray:
        """``int64`` physical slots of positions ``[starts[i], starts[i] + counts[i])`` of row ``rows[i]``,
        concatenated (a step's chunks)."""
        start = np.asarray(starts, dtype=np.int64)
        count = np.asarray(counts, dtype=np.int64)
        first = np.cumsum(count) - count
        positions = np.repeat(start - first, count) + np.arange(int(count.sum()), dtype=np.int64)
        return self.slots(np.repeat(rows, count), positions)

    def check_row(self, row: int, block_ids: Sequence[int]) -> None:
        """Assert that ``row`` holds exactly ``block_ids`` followed by zeros."""
        n = len(block_ids)
        assert int(self.lengths[row]) == n, f"row {row}: length {self.lengths[row]} != {n}"
        assert self.table[row, :n].tolist() == list(block_ids), f"row {row} out of sync"
        assert not self.table[row, n:].any(), f"row {row}: nonzero padding"

    def check_free_rows(self) -> None:
        """Assert that free rows are empty and not duplicated."""
        assert len(set(self._free_rows)) == len(self._free_rows)
        if self._free_rows:
            assert not self.table[self._free_rows].any() and not self.lengths[self._free_rows].any()
