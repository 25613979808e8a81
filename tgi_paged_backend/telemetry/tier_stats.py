"""The KV tiers below the pool (issue 42) as telemetry sees them: one cumulative snapshot per step.

Pure data, duck-typed on the engine's objects (telemetry imports no engine module). What it reads:

- ``kv.tiers`` (``memory.prefix_tiers.PrefixTiers``): ``counters`` (``loaded_blocks``, ``lost_blocks``,
  ``swap_kept_rows``),
  ``host`` (``num_used_rows``, ``num_rows``, ``num_evicted``), ``block_size``;
- ``tier_io.traffic`` (``offload.tier_io.TierTraffic``): bytes and seconds each way;
- ``disk.stats()`` (``offload.disk_store.DiskStoreStats``), when a disk tier is configured;
- the engine's cumulative ``prefix_hit_tokens`` and ``disk_hit_tokens``.

A prompt's prefix hit is split by the tier its blocks came from: blocks loaded from the host tier count
``loaded_blocks x block_size`` tokens, of which those first read from disk (``disk_hit_tokens``) count as
the disk's; the rest of the hit is the pool's own. The three add up to ``prefix_hit_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TIERS: tuple[str, ...] = ("pool", "host", "disk")
TIER_DIRECTIONS: tuple[str, ...] = ("offload", "load", "spill", "fetch")
"""offload: pool -> host; load: host -> pool; spill: host -> disk (written by the disk's thread); fetch:
disk -> host."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    """Cumulative since the process started (the host-tier counters: since the pool was last built)."""

    hit_tokens: dict[str, int]
    """Prefix-hit tokens by the tier that served them (:data:`TIERS`)."""
    moved_bytes: dict[str, int]
    """Bytes moved by direction (:data:`TIER_DIRECTIONS`)."""
    moved_s: dict[str, float]
    """Seconds spent moving them, by direction."""
    host_rows_used: int
    host_rows_total: int
    host_evicted_blocks: int
    """Host entries evicted for room (written through to disk when a disk tier is on)."""
    host_lost_blocks: int
    """Blocks the pool evicted that the host tier had no room for (every row pinned)."""
    swap_kept_blocks: int = 0
    """Blocks swap preemptions left in the host tier instead of copying them to swap space."""
    disk: Any = None
    """The disk store's ``DiskStoreStats`` (``None``: no disk tier)."""


def collect_tier_stats(
    kv: Any, tier_io: Any, disk: Any, *, prefix_hit_tokens: int, disk_hit_tokens: int
) -> TierStats | None:
    """The snapshot of ``kv``'s tiers (``None`` when it has none)."""
    tiers = kv.tiers
    if tiers is None:
        return None
    traffic = tier_io.traffic
    disk_stats = disk.stats() if disk is not None else None
    loaded_tokens = tiers.counters.loaded_blocks * tiers.block_size
    return TierStats(
        hit_tokens={
            "pool": max(prefix_hit_tokens - loaded_tokens, 0),
            "host": max(loaded_tokens - disk_hit_tokens, 0),
            "disk": disk_hit_tokens,
        },
        moved_bytes={
            "offload": traffic.offload_bytes,
            "load": traffic.load_bytes,
            "spill": disk_stats.write_bytes if disk_stats is not None else 0,
            "fetch": traffic.fetch_bytes,
        },
        moved_s={
            "offload": traffic.offload_s,
            "load": traffic.load_s,
            "spill": disk_stats.write_seconds if disk_stats is not None else 0.0,
            "fetch": traffic.fetch_s,
        },
        host_rows_used=tiers.host.num_used_rows,
        host_rows_total=tiers.host.num_rows,
        host_evicted_blocks=tiers.host.num_evicted,
        host_lost_blocks=tiers.counters.lost_blocks,
        swap_kept_blocks=tiers.counters.swap_kept_rows,
        disk=disk_stats,
    )
