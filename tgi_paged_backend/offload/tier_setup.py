"""Builds a shard's KV tiers from its config and runner: the host arena, the disk store, the fingerprint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from loguru import logger

from tgi_paged_backend.config import BackendConfig
from tgi_paged_backend.memory.prefix_tiers import TierObserver, TierSetup
from tgi_paged_backend.offload.disk_store import DiskFingerprint, DiskStore
from tgi_paged_backend.offload.tier_io import TierIO
from tgi_paged_backend.offload.tier_sizing import host_tier_bytes
from tgi_paged_backend.runner.memory_budget import cpu_available_bytes

if TYPE_CHECKING:
    from tgi_paged_backend.runner.model_runner import ModelRunner


def kv_fingerprint(config: BackendConfig, runner: ModelRunner) -> DiskFingerprint:
    """What makes two processes' K/V blocks interchangeable: model, revision, KV dtype, block size, the
    pool's row layout (layer groups, this rank of the TP world) and the LoRA adapters by name."""
    pool = runner.pool
    server = config.server
    layout = (
        f"windows={runner.kv_groups.windows} slots={pool.groups.layers_per_block} "
        f"rank={server.rank}/{server.world_size}"
    )
    return DiskFingerprint(
        model=config.model.model_id,
        revision=config.model.revision or "",
        kv_dtype=str(pool.kv_dtype).removeprefix("torch."),
        block_size=pool.block_size,
        row_shape=pool.host_row_shape(),
        layout=layout,
        adapters=tuple(runner.lora.names) if runner.lora is not None else (),
    )


def build_kv_tiers(
    config: BackendConfig,
    runner: ModelRunner,
    *,
    swap_bytes: int,
    disk: DiskStore | None,
    observer: TierObserver | None = None,
) -> tuple[TierIO, TierSetup | None, DiskStore | None]:
    """Allocate the host arena beside ``runner``'s pool (after it) and say how the manager keeps the tier.
    ``disk``: the store opened by an earlier call (the pool is rebuilt at Warmup; the files stay)."""
    cache = config.cache
    num_bytes = host_tier_bytes(
        cache.host_cache_bytes,
        device_type=runner.device.type,
        swap_bytes=swap_bytes,
        available_host_bytes=cpu_available_bytes(),
        prefix_caching=cache.prefix_caching,
        disk=bool(cache.disk_cache_dir),
    )
    rows = num_bytes // runner.pool.block_bytes
    runner.pool.allocate_host_tier(rows)
    fingerprint = kv_fingerprint(config, runner)
    if rows and cache.disk_cache_dir and disk is None:
        directory = Path(cache.disk_cache_dir) / f"rank-{config.server.rank}"
        disk = DiskStore(directory, cache.disk_cache_bytes, fingerprint)
        logger.info(
            "KV disk tier: {} ({} files, {:.1f} GiB cap)",
            directory,
            disk.stats().num_files,
            cache.disk_cache_bytes / 2**30,
        )
    tier_io = TierIO(runner.pool, disk if rows else None)
    if not rows:
        return tier_io, None, disk
    logger.info("KV host tier: {} blocks, {:.1f} GiB", rows, rows * runner.pool.block_bytes / 2**30)
    spill = tier_io.spill if tier_io.disk is not None else None
    return tier_io, TierSetup(rows, fingerprint.digest(), spill=spill, observer=observer), disk
