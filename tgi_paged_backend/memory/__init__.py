"""KV memory management: physical block pool, page maps, prefix retention, swap space, waste.

Pure Python + numpy (no torch, no grpc). The engine talks to :class:`KVCacheManager` only; the other
modules are its parts:

- ``block_pool``: free / used (refcounted) / retained physical blocks, O(1) per block.
- ``prefix_cache``: content-addressed, token-verified retention of full blocks; copy-on-write plans.
- ``swap_space``: CPU block ids for swapped-out requests.
- ``page_map``: one request's token positions -> physical blocks.
- ``block_table``: persistent ``int32`` block-table rows; slot mappings as numpy gathers.
- ``window_reclaim``: sliding-window block reclaim (which blocks no query reads any more).
- ``stats``: occupancy and waste accounting.
- ``invariants``: the books checked against each other (tests).
- ``types``: the result objects handed to the engine and the runner.
"""

from tgi_paged_backend.memory.kv_cache_manager import KVCacheManager
from tgi_paged_backend.memory.stats import MemoryStats
from tgi_paged_backend.memory.types import (
    SCRATCH_BLOCK,
    Allocation,
    BlockCopy,
    PrefixMatch,
    RequestMemory,
    SwapPlan,
)

__all__ = [
    "SCRATCH_BLOCK",
    "Allocation",
    "BlockCopy",
    "KVCacheManager",
    "MemoryStats",
    "PrefixMatch",
    "RequestMemory",
    "SwapPlan",
]
