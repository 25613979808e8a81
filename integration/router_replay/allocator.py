"""The stock router's KV block allocator (``SimpleAllocator``), replayed.

The router owns the KV address space: ``floor(max_batch_total_tokens / block_size)`` blocks, of which
block 0 is never handed out (the liveness probe writes it). The free list starts as ``[1 .. n-1]``;
allocations take blocks from its **tail** and frees append to its tail, so reuse is LIFO and the first
allocation on a fresh router gets the highest-numbered blocks in ascending order.

A request reserves ``input_length + max_new_tokens + speculate - 1`` slots up front. Its slot list is
``block * block_size + offset`` for each block in order, cut to exactly that many slots. With a
``window_size`` the block count is capped at the window and the slot list cycles through the same
blocks (a ring buffer).

In the stock router an allocation frees itself when it is dropped; here the owner calls
:meth:`BlockAllocation.free` (idempotent) at the same moments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def slots_for_blocks(blocks: Sequence[int], block_size: int, tokens: int) -> list[int]:
    """All slots of ``blocks`` in order, truncated to ``tokens`` entries."""
    slots: list[int] = []
    for block in blocks:
        base = block * block_size
        take = min(block_size, tokens - len(slots))
        slots.extend(range(base, base + take))
        if len(slots) == tokens:
            break
    return slots


class Allocator(Protocol):
    block_size: int
    num_blocks: int

    def allocate(self, tokens: int, prefill_tokens: Sequence[int] | None) -> BlockAllocation | None: ...

    def free(self, blocks: list[int], allocation_id: int) -> None: ...

    def free_block_count(self) -> int: ...


@dataclass(eq=False)
class BlockAllocation:
    """Blocks and slots reserved for one request; ``prefix_len`` becomes ``Request.cache_len``."""

    blocks: list[int]
    slots: list[int]
    prefix_len: int
    allocation_id: int = 0
    allocator: Allocator | None = field(default=None, repr=False)
    freed: bool = False

    def free(self) -> None:
        """Return the blocks (the stock ``Drop``); a second call does nothing."""
        if self.freed or self.allocator is None:
            return
        self.freed = True
        self.allocator.free(list(self.blocks), self.allocation_id)


class SimpleAllocator:
    """Free-list allocator used when the shard does not advertise prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, window_size: int | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window_size = window_size
        # Block 0 is reserved for the liveness probe.
        self.free_blocks: list[int] = list(range(1, num_blocks))

    def free_block_count(self) -> int:
        return len(self.free_blocks)

    def allocate(self, tokens: int, prefill_tokens: Sequence[int] | None = None) -> BlockAllocation | None:
        del prefill_tokens  # only the radix allocator looks at the prompt
        if self.window_size is None:
            capped, repeats = tokens, 1
        else:
            capped, repeats = min(tokens, self.window_size), ceil_div(tokens, self.window_size)
        required = ceil_div(capped, self.block_size)
        if required > len(self.free_blocks):
            return None
        split = len(self.free_blocks) - required
        blocks = self.free_blocks[split:]
        del self.free_blocks[split:]
        slots = slots_for_blocks(blocks * repeats, self.block_size, tokens)
        return BlockAllocation(blocks=blocks, slots=slots, prefix_len=0, allocation_id=0, allocator=self)

    def free(self, blocks: list[int], allocation_id: int) -> None:
        del allocation_id
        self.free_blocks.extend(blocks)


def make_allocator(
    max_batch_total_tokens: int, block_size: int, prefix_caching: bool, window_size: int | None
) -> Allocator:
    """The allocator the stock queue builds for a paged shard (``requires_padding = false``)."""
    from .radix import RadixAllocator

    num_blocks = max_batch_total_tokens // block_size
    if prefix_caching:
        return RadixAllocator(block_size, num_blocks, window_size)
    return SimpleAllocator(num_blocks, block_size, window_size)
