"""The host tier's automatic size (``offload.tier_sizing``) and the disk tier's need of one."""

from __future__ import annotations

import pytest

from tgi_paged_backend.config import CacheConfig, ConfigError
from tgi_paged_backend.offload.tier_sizing import AUTO_HOST_TIER_CAP_BYTES, DISK_STAGING_BYTES, host_tier_bytes

GIB = 1024**3


def _size(configured=None, *, device="cuda", swap=4 * GIB, free=64 * GIB, prefix=True, disk=False) -> int:
    return host_tier_bytes(
        configured, device_type=device, swap_bytes=swap, available_host_bytes=free, prefix_caching=prefix, disk=disk
    )


def test_the_configured_size_wins_and_nothing_is_kept_without_prefix_caching():
    assert _size(3 * GIB) == 3 * GIB
    assert _size(3 * GIB, prefix=False) == 0
    assert _size(prefix=False, disk=True) == 0


def test_automatic_on_an_accelerator_is_half_the_free_ram_less_swap_capped():
    assert _size(free=64 * GIB, swap=4 * GIB) == 28 * GIB
    assert _size(free=1024 * GIB) == AUTO_HOST_TIER_CAP_BYTES
    assert _size(free=6 * GIB, swap=4 * GIB) == 0


def test_automatic_on_cpu_is_off_unless_a_disk_tier_needs_a_staging_tier():
    assert _size(device="cpu") == 0
    assert _size(device="cpu", disk=True) == DISK_STAGING_BYTES
    assert _size(device="cpu", disk=True, free=2 * GIB) == GIB // 2


def test_a_disk_tier_with_the_host_tier_set_to_zero_is_refused():
    with pytest.raises(ConfigError, match="needs a host tier"):
        CacheConfig(disk_cache_dir="/tmp/kv", host_cache_bytes=0)
    CacheConfig(disk_cache_dir="/tmp/kv")  # automatic: fine
