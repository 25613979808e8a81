"""Result objects the memory manager hands to the engine and the runner.

These are the boundary between :class:`~tgi_paged_backend.memory.kv_cache_manager.KVCacheManager`
and its callers (in the spirit of vLLM's ``KVCacheBlocks``): they carry block *ids* only, never pool
objects, so the engine and the runner cannot reach into the pool's internal state.

Copy ordering rule (for the runner): every copy the manager issues -- ``SwapPlan`` from
``swap_out``/``swap_in`` and ``BlockCopy`` from ``allocate`` -- must be executed in the order the
calls returned them, and all of them before the forward pass that writes new K/V. A block released
by one call may be handed out by a later call of the same step; issue order makes that safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SCRATCH_BLOCK = 0
"""Physical block 0: never handed out; backs router virtual block 0 and the padding of block tables."""


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy-on-write: copy slots ``[0, num_tokens)`` of physical block ``src`` into physical block ``dst``.

    Copying the whole block is also correct (the slots past ``num_tokens`` are overwritten later).
    """

    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one successful :meth:`KVCacheManager.allocate` call did.

    Attributes:
        new_blocks: Physical blocks newly mapped to the request, in token order.
        copies: Copy-on-write copies the runner must perform before the forward pass.
    """

    new_blocks: tuple[int, ...] = ()
    copies: tuple[BlockCopy, ...] = ()


EMPTY_ALLOCATION = Allocation()
"""Shared result for the common decode case "nothing to do" (no garbage on the hot path)."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Outcome of :meth:`KVCacheManager.match_prefix`.

    ``num_cached_tokens`` leading prompt tokens need no compute: ``num_shared_blocks`` full blocks are
    shared with other holders (refcounted), and ``num_copy_tokens`` more are valid in a retained block
    that a copy-on-write brings in (``copy_src``). The copy itself (with its destination block) comes
    back in the ``copies`` of the first :meth:`KVCacheManager.allocate` that covers position
    ``num_shared_blocks * block_size``. ``num_cached_tokens < len(prompt_ids)`` always holds, so at
    least one token is computed (its logits are needed).
    """

    num_cached_tokens: int = 0
    num_shared_blocks: int = 0
    copy_src: int | None = None
    num_copy_tokens: int = 0


NO_MATCH = PrefixMatch()


@dataclass(frozen=True, slots=True)
class SwapPlan:
    """Block copies between the device pool and the CPU swap space for one request.

    ``direction == "out"``: ``src_blocks`` are device blocks, ``dst_blocks`` CPU blocks; ``"in"`` the
    reverse. ``src_blocks[i]`` goes to ``dst_blocks[i]``. The source blocks are already released in
    the manager's books when the plan is returned (see the copy ordering rule in the module docstring).
    """

    request_id: int
    direction: Literal["out", "in"]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.src_blocks)


@dataclass(frozen=True, slots=True)
class RequestMemory:
    """One request's memory footprint, for victim choice and preemption cost estimates."""

    num_blocks: int
    """Blocks mapped (physical while resident, CPU while swapped), scratch excluded."""
    num_exclusive_blocks: int
    """Physical blocks held by this request alone: what preempting it gives back."""
    num_committed_tokens: int
    """Tokens with valid K/V (what a recompute preemption has to recompute)."""
    is_swapped: bool
