"""How many bytes the host tier gets (``TGI_PAGED_HOST_CACHE_GB``, or automatic)."""

from __future__ import annotations

AUTO_HOST_TIER_CAP_BYTES = 64 * 1024**3
"""The automatic host tier never takes more than this (a larger one is the user's explicit choice)."""


def host_tier_bytes(
    configured: int | None, *, device_type: str, swap_bytes: int, available_host_bytes: int, prefix_caching: bool
) -> int:
    """The host tier's size in bytes.

    ``configured`` (``TGI_PAGED_HOST_CACHE_GB``) wins when set. Automatic (``None``): off without prefix
    caching (nothing is retained, so nothing is evicted) and on CPU devices (the pool lives in host RAM
    there: RAM the tier would take is better spent on a larger pool, which attention reads directly);
    on an accelerator half the host RAM available at start, less the swap space (its own arena), at most
    :data:`AUTO_HOST_TIER_CAP_BYTES` -- llm-d's advice is to offload whenever host RAM exceeds device
    memory, and half leaves room for the process, the page cache and the other ranks' tiers.
    """
    if not prefix_caching:
        return 0
    if configured is not None:
        return configured
    if device_type == "cpu":
        return 0
    return max(0, min(available_host_bytes // 2 - swap_bytes, AUTO_HOST_TIER_CAP_BYTES))
