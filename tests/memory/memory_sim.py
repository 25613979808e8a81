"""A stand-in for the runner: device and CPU blocks hold one content code per slot.

The code of token position ``p`` is a rolling hash of ``history[:p + 1]``, so it captures what real
K/V depends on (the token, its position and everything before it). Tests write codes through the
manager's slot mappings, execute its copy plans in issue order, and read codes back to check that
every request sees exactly its own history -- shared, copied or swapped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tgi_paged_backend.memory import Allocation, KVCacheManager, SwapPlan

_MOD = (1 << 61) - 1


def content_codes(token_ids: Sequence[int]) -> np.ndarray:
    """Per-position prefix codes of a token history."""
    codes = np.empty(len(token_ids), dtype=np.int64)
    h = 7
    for i, t in enumerate(token_ids):
        h = (h * 1_000_003 + int(t) + 1) % _MOD
        codes[i] = h
    return codes


class KVSim:
    """Device pool and swap space as ``int64 [num_blocks, block_size]`` code arrays (-1 = garbage)."""

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0, num_host_rows: int = 0) -> None:
        self.block_size = block_size
        self.device = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.cpu = np.full((max(num_swap_blocks, 1), block_size), -1, dtype=np.int64)
        self.host = np.full((max(num_host_rows, 1), block_size), -1, dtype=np.int64)
        self.tier_moves: dict[str, int] = {"offload": 0, "load": 0}

    def apply_tier_moves(self, manager: KVCacheManager) -> None:
        """Run the host-tier copies the manager issued since the last call (issue order), then mark them
        landed, as the engine does after a step's copies."""
        for kind, src, dst in manager.take_tier_moves():
            if kind == "offload":
                self.host[dst] = self.device[src]
            else:
                assert kind == "load", kind
                self.device[dst] = self.host[src]
            self.tier_moves[kind] += 1
        if manager.tiers is not None:
            manager.tiers.moves_landed()

    def apply_allocation(self, allocation: Allocation) -> None:
        for copy in allocation.copies:
            self.device[copy.dst, : copy.num_tokens] = self.device[copy.src, : copy.num_tokens]

    def apply_swap(self, plan: SwapPlan) -> None:
        src, dst = list(plan.src_blocks), list(plan.dst_blocks)
        if plan.direction == "out":
            self.cpu[dst] = self.device[src]
        else:
            self.device[dst] = self.cpu[src]

    def write(self, manager: KVCacheManager, request_id: int, history: Sequence[int], start: int, end: int) -> None:
        """Write the codes of positions ``[start, end)`` where the manager maps them, in every layer group
        (group ``g``'s codes are salted with ``g``: a block read through another group's table shows)."""
        if end <= start:
            return
        codes = content_codes(history)[start:end]
        for g in range(manager.num_groups):
            slots = manager.slot_mapping([request_id], [start], [end - start], group=g)
            self.device.reshape(-1)[slots] = codes + g

    def read(
        self, manager: KVCacheManager, request_id: int, num_tokens: int, start: int = 0, group: int = 0
    ) -> np.ndarray:
        if num_tokens <= start:
            return np.empty(0, dtype=np.int64)
        slots = manager.slot_mapping([request_id], [start], [num_tokens - start], group=group)
        return self.device.reshape(-1)[slots] - group

    def assert_holds(
        self, manager: KVCacheManager, request_id: int, history: Sequence[int], num_tokens: int, start: int = 0
    ) -> None:
        """Positions ``[start, num_tokens)`` of the request read back as its history (``start`` > 0:
        the sliding window of the latest query, the blocks before it may be holes); in a sliding group
        from its own window of the latest query on."""
        for g, window in enumerate(manager.group_windows):
            # a sliding group: what a query at num_tokens reads (the later of the two callers' queries)
            first = start if window is None or manager.num_groups == 1 else max(start, num_tokens - window + 1, 0)
            got = self.read(manager, request_id, num_tokens, first, group=g)
            want = content_codes(history)[first:num_tokens]
            assert np.array_equal(got, want), f"request {request_id}: K/V content of group {g} differs from its history"
