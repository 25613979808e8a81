"""How many bytes the host tier gets (``TGI_PAGED_HOST_CACHE_GB``, or automatic)."""

from __future__ import annotations

AUTO_HOST_TIER_CAP_BYTES = 64 * 1024**3
"""The automatic host tier never takes more than this (a larger one is the user's explicit choice)."""


DISK_STAGING_BYTES = 1024**3
"""The automatic host tier on CPU when a disk tier is asked for: the disk tier sits below the host tier
(blocks reach disk through it), so it cannot be 0 there."""


def host_tier_bytes(
    configured: int | None,
    *,
    device_type: str,
    swap_bytes: int,
    available_host_bytes: int,
    prefix_caching: bool,
    disk: bool = False,
) -> int:
    """The host tier's size in bytes.

    ``configured`` (``TGI_PAGED_HOST_CACHE_GB``) wins when set. Automatic (``None``): off without prefix
    caching (nothing is retained, so nothing is evicted) and on CPU devices (the pool lives in host RAM
    there: RAM the tier would take is better spent on a larger pool, which attention reads directly);
    on an accelerator half the host RAM available at start, less the swap space (its own arena), at most
    :data:`AUTO_HOST_TIER_CAP_BYTES` -- llm-d's advice is to offload whenever host RAM exceeds device
    memory, and half leaves room for the process, the page cache and the other ranks' tiers. On CPU with a
    disk tier (``disk``): :data:`DISK_STAGING_BYTES`, at most a quarter of the free RAM.
    """
    if not prefix_caching:
        return 0
    if configured is not None:
        return configured
    if device_type == "cpu":  # with a disk tier: a staging tier of at most a quarter of the free RAM
        return min(DISK_STAGING_BYTES, available_host_bytes // 4) if disk else 0
    return max(0, min(available_host_bytes // 2 - swap_bytes, AUTO_HOST_TIER_CAP_BYTES))
