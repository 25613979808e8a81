"""One request's page map: token positions -> physical blocks, plus what it needs to be rebuilt.

Block ``i`` of a request holds token positions ``[i * block_size, (i + 1) * block_size)``. Physical
blocks are always mapped as a prefix of the page map (lazily, as positions are written)::

    positions:  0 ...... num_committed ...... len(blocks) * bs .......... len(virtual_blocks) * bs
    blocks:     [ shared | own, written | own, allocated ahead ] [ router reservation: costs nothing ]

With a sliding-window model (:mod:`.window_reclaim`) the leading ``num_holes`` entries are *holes*:
blocks wholly outside every layer's window, given back to the pool and mapped to the scratch block::

    blocks:     [ holes (scratch) | inside the window: written | allocated ahead ]

``virtual_blocks`` are the router's addresses (empty for self-managed requests); router virtual block
0 (the liveness probe's) always maps to the scratch block and is never backed by the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tgi_paged_backend.memory.prefix_cache import CHAIN_START, ChainCursor
from tgi_paged_backend.memory.types import SCRATCH_BLOCK


@dataclass(slots=True, eq=False)
class PageMap:
    """Mutable memory record of one live request (owned by the ``KVCacheManager``)."""

    row: int
    """Row of the request in the persistent block-table array."""
    virtual_blocks: tuple[int, ...]
    """Router blocks for the whole sequence; ``()`` when the shard manages the request itself."""
    blocks: list[int]
    """Physical blocks in token order (scratch where the router's virtual block is 0)."""
    token_ids: list[int]
    """Token history known so far (prompt + generated)."""
    num_committed: int = 0
    """Leading tokens whose K/V is valid (written, shared, or brought by the pending copy)."""
    num_allocated_tokens: int = 0
    """Largest ``num_tokens`` the engine asked to back: positions it is writing or has written."""
    cow_src: int | None = None
    """Pinned copy-on-write source, until the allocation that maps its destination."""
    num_cow_tokens: int = 0
    swapped: list[int] | None = None
    """CPU blocks while swapped out (``blocks`` is then empty)."""
    num_swapped_positions: int = 0
    """Length of ``blocks`` at swap-out (scratch entries included)."""
    swapped_host: list[tuple[int, int]] = field(default_factory=list)
    """While swapped out: ``(index among the live blocks, host-tier row)`` of the blocks left in the host
    tier instead of copied to swap space (:mod:`.swap_moves`)."""
    swap_pins: tuple[bytes, ...] = ()
    """While swapped out, in the anchor group: the host-tier entries those blocks come back from (pinned)."""
    extra_blocks: int = 0
    """Blocks it may map past the router's reservation (a server-side prompt longer than the router's count:
    PaliGemma's ``<bos>`` + text + ``\n`` wrap; ``engine.image_prompts.ImagePrompts.router_slack``)."""
    has_scratch: bool = False
    """Some virtual block is 0 (the liveness probe's): it maps to the scratch block."""
    num_holes: int = 0
    """Leading entries given back because they fell outside the sliding window (scratch now)."""
    chain: ChainCursor = CHAIN_START
    """How far the blocks are registered for prefix reuse (the chain goes on past holes from here)."""
    chain_root: ChainCursor = CHAIN_START
    """Where this request's chain starts: its LoRA adapter's root (:func:`.prefix_cache.chain_root`)."""
    serials: list[int] = field(default_factory=list)
    """With several KV layer groups, in the anchor group: the registry entry of each block the chain
    walked (``chain.num_blocks`` of them); the other groups attach their blocks to these."""
    _virtual_lookup: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def create(cls, row: int, virtual_blocks: tuple[int, ...], chain_root: ChainCursor = CHAIN_START) -> PageMap:
        return cls(
            row=row,
            virtual_blocks=virtual_blocks,
            blocks=[],
            token_ids=[],
            has_scratch=SCRATCH_BLOCK in virtual_blocks,
            chain=chain_root,
            chain_root=chain_root,
        )

    @property
    def num_physical_blocks(self) -> int:
        """Mapped blocks that come from the pool (scratch excluded)."""
        if self.has_scratch:
            return sum(1 for b in self.blocks if b != SCRATCH_BLOCK)
        return len(self.blocks) - self.num_holes if self.blocks else 0

    @property
    def num_swapped_blocks(self) -> int:
        """Live blocks of a swapped-out map: in swap space plus left in the host tier."""
        return len(self.swapped or ()) + len(self.swapped_host)

    @property
    def max_mappable_blocks(self) -> int | None:
        """How far a prefix match may map: the reservation, or up to virtual block 0; ``None``: no cap."""
        if not self.virtual_blocks:
            return None
        if self.has_scratch:
            return self.virtual_blocks.index(SCRATCH_BLOCK)
        return len(self.virtual_blocks)

    def num_fresh_blocks(self, num_blocks: int) -> int:
        """Pool blocks needed to extend the map to ``num_blocks`` blocks (scratch entries are free)."""
        start = len(self.blocks)
        if num_blocks <= start:
            return 0
        if self.has_scratch:
            return sum(1 for v in self.virtual_blocks[start:num_blocks] if v != SCRATCH_BLOCK)
        return num_blocks - start

    def extension(self, fresh: Sequence[int], num_blocks: int) -> list[int]:
        """Blocks to append for positions up to block ``num_blocks``, given the fresh pool blocks."""
        if not self.has_scratch:
            assert len(fresh) == num_blocks - len(self.blocks)
            return list(fresh)
        ids = iter(fresh)
        return [
            SCRATCH_BLOCK if v == SCRATCH_BLOCK else next(ids)
            for v in self.virtual_blocks[len(self.blocks) : num_blocks]
        ]

    def virtual_block_indices(self, virtual_ids: np.ndarray) -> np.ndarray:
        """Page-map indices of router virtual block ids (none of them 0).

        Raises:
            ValueError: An id is not one of this request's virtual blocks.
        """
        if self._virtual_lookup is None:
            ids = np.asarray(self.virtual_blocks, dtype=np.int64)
            order = np.argsort(ids, kind="stable")
            self._virtual_lookup = (ids[order], order)
        sorted_ids, order = self._virtual_lookup
        if len(sorted_ids) == 0:
            raise ValueError("router slot for a request without router blocks")
        pos = np.minimum(np.searchsorted(sorted_ids, virtual_ids), len(sorted_ids) - 1)
        if not (sorted_ids[pos] == virtual_ids).all():
            raise ValueError("router slot outside the request's virtual blocks")
        return order[pos]
