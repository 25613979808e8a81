"""Synthetic engine-step records shared by the telemetry tests."""

from __future__ import annotations

from pathlib import Path

from tgi_paged_backend.memory.stats import MemoryStats
from tgi_paged_backend.offload.disk_store import DiskStoreStats
from tgi_paged_backend.telemetry.step_record import MemoryBudget, PreemptionRecord, StepRecord
from tgi_paged_backend.telemetry.tier_stats import TierStats

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples" / "observability"

GiB = 1024**3
BUDGET = MemoryBudget(
    device_total_bytes=80 * GiB,
    weights_bytes=16 * GiB,
    activation_peak_bytes=2 * GiB,
    pool_bytes=50 * GiB,
    swap_bytes=4 * GiB,
)


def memory_stats(**overrides) -> MemoryStats:
    """A plausible pool: 100 blocks x 16 tokens, 75 used (usage 0.75), 5 retained, 3 swapped; two KV layer
    groups (full, and a sliding window of 4096) sharing the used blocks."""
    values = dict(
        block_size=16,
        num_total_blocks=100,
        num_free_blocks=17,
        num_used_blocks=75,
        num_retained_blocks=5,
        num_swapped_blocks=3,
        num_swap_total_blocks=50,
        num_requests=4,
        num_swapped_requests=1,
        num_written_tokens=1100,
        num_reserved_slots=4000,
        internal_waste_slots=100,
        reservation_waste_slots=2800,
        external_waste_blocks=0,
        num_prefix_query_tokens=0,
        num_prefix_hit_tokens=0,
        group_windows=(None, 4096),
        group_blocks=(60, 15),
        group_hole_blocks=(0, 45),
        group_internal_waste_slots=(60, 40),
    )
    values.update(overrides)
    return MemoryStats(**values)


TIERS = TierStats(
    hit_tokens={"pool": 16, "host": 8, "disk": 8},
    moved_bytes={"offload": 6000, "load": 3000, "spill": 5000, "fetch": 2000},
    moved_s={"offload": 0.5, "load": 0.25, "spill": 1.5, "fetch": 0.75},
    host_rows_used=30,
    host_rows_total=40,
    host_evicted_blocks=7,
    host_lost_blocks=1,
    swap_kept_blocks=5,
    disk=DiskStoreStats(num_files=12, num_bytes=12_000, max_bytes=16_000, evicted_files=3, ignored_files=2),
)
"""The KV tiers after the last sample step: the 32 prefix-hit tokens split 16/8/8 over pool, host, disk."""


def sample_steps() -> list[StepRecord]:
    """A prefill, a decode that preempts two victims (one per mode), and a decode that resumes one.

    Totals: preemptions recompute=1 swap=1; recomputed tokens 40; swap out 8192 B, in 4096 B;
    prefix hit/query 32/96; step phases prefill=1 decode=2; batch sizes 4, 3, 4; resumed waits [2.0];
    grammar compiles [0.2] with 1 cache hit; constrained rows 2 then 1; step anatomy (decode steps):
    forward 0.010 + 0.012 s, schedule 0.002 + 0.003 s, sample 0.001 s each (prefill: forward 0.1 s).
    The last pool snapshot has usage 0.75.
    """
    return [
        StepRecord(
            phase="prefill",
            step_s=0.120,
            batch_size=4,
            tokens_computed=512,
            blocks_allocated=32,
            prefix_hit_tokens=32,
            prefix_query_tokens=96,
            num_running=4,
            constrained_rows=2,
            grammar_compile_s=(0.2,),
            grammar_cache_hits=1,
            part_s=(("forward", 0.1), ("schedule", 0.02)),
            memory=memory_stats(num_used_blocks=60, num_free_blocks=32),
        ),
        StepRecord(
            phase="decode",
            step_s=0.015,
            batch_size=3,
            tokens_computed=3,
            blocks_allocated=1,
            preemptions=(
                PreemptionRecord(mode="recompute", victim_id=11, tokens_lost=40, estimated_cost_s=0.02),
                PreemptionRecord(mode="swap", victim_id=12, tokens_lost=64, estimated_cost_s=0.004),
            ),
            swap_out_bytes=8192,
            num_running=2,
            num_preempted=2,
            max_preempted_wait_s=0.0,
            constrained_rows=1,
            part_s=(("forward", 0.010), ("schedule", 0.002), ("sample", 0.001)),
            memory=memory_stats(num_used_blocks=80, num_free_blocks=12),
        ),
        StepRecord(
            phase="decode",
            step_s=0.018,
            batch_size=4,
            tokens_computed=43,
            tokens_recomputed=40,
            swap_in_bytes=4096,
            resumed_wait_s=(2.0,),
            num_running=3,
            num_waiting=1,
            num_preempted=1,
            max_preempted_wait_s=2.5,
            part_s=(("forward", 0.012), ("schedule", 0.003), ("sample", 0.001)),
            memory=memory_stats(),
            tiers=TIERS,
        ),
    ]
