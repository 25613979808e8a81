"""What the engine reports to telemetry: one :class:`StepRecord` per step, one :class:`MemoryBudget` per sizing,
one :class:`SnapshotRecord` after an RPC that freed requests outside a step.

Pure data (no OpenTelemetry imports), so the engine can build records whether or not an exporter is
configured. Counts in a record are for that step only (deltas); the pool snapshot in ``memory`` is the
state right after the step. The recorder turns deltas into counters and the snapshot into gauges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tgi_paged_backend.memory.stats import MemoryStats
from tgi_paged_backend.telemetry.lora_usage import LoraUsage
from tgi_paged_backend.telemetry.tier_stats import TierStats

Phase = Literal["prefill", "decode"]
PHASES: tuple[str, ...] = ("prefill", "decode")
PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap")
SWAP_DIRECTIONS: tuple[str, ...] = ("out", "in")
STEP_PARTS: tuple[str, ...] = ("schedule", "copy", "prepare", "forward", "sample", "detokenize", "telemetry")
"""Where a step's wall time goes (``tgi_paged_step_part_seconds{part}``): ``schedule`` (planning,
admission, preemption choice and the bookkeeping after the forward: computed-token accounting,
stats, freeing finished requests), ``copy`` (swap and copy-on-write block copies), ``prepare``
(input tensors: ids, positions, slots, block tables), ``forward`` (the model; synchronised on CUDA),
``sample`` (grammar masks, penalties, token choice), ``detokenize`` (incremental text, stop checks,
``Generation`` records), ``telemetry`` (building and recording the *previous* step's record: a step
cannot time its own report)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PreemptionRecord:
    """One victim preempted during a step."""

    mode: str
    """``recompute`` (blocks dropped) or ``swap`` (blocks copied to CPU)."""
    victim_id: int
    """Router request id of the victim."""
    tokens_lost: int
    """Tokens whose K/V left the device (dropped or swapped out)."""
    estimated_cost_s: float
    """The policy's estimate of what resuming will cost, in seconds."""

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode={self.mode!r} is invalid: allowed {PREEMPTION_MODES}")
        if self.tokens_lost < 0:
            raise ValueError(f"tokens_lost={self.tokens_lost} is invalid: allowed >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One engine step (one forward, or an idle step where every request waited)."""

    phase: Phase
    """``prefill`` when any request computed more than one token this step, else ``decode``."""
    step_s: float
    """Wall time of the step (block copies + forward + sampling), in seconds."""
    batch_size: int
    """Requests computed in this step (preempted requests that stayed waiting are not counted)."""
    tokens_computed: int
    """Positions whose K/V was computed, recomputed ones included."""
    tokens_recomputed: int = 0
    """Of ``tokens_computed``, positions computed again after a recompute-mode preemption."""
    blocks_allocated: int = 0
    """Physical blocks newly mapped for this step."""
    preemptions: tuple[PreemptionRecord, ...] = ()
    """Victims preempted while planning this step, in order."""
    swap_out_bytes: int = 0
    """Bytes copied device -> CPU (swap-out of victims)."""
    swap_in_bytes: int = 0
    """Bytes copied CPU -> device (swap-in of resumed requests)."""
    prefix_hit_tokens: int = 0
    """Prompt tokens served from the prefix cache since the previous record."""
    prefix_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache since the previous record."""
    image_tokens: int = 0
    """Image placeholder positions computed in this step (a vision-language model's)."""
    images_encoded: int = 0
    """Images run through the vision tower in this step."""
    resumed_wait_s: tuple[float, ...] = ()
    """For each request resumed in this step: seconds it spent preempted."""
    num_running: int = 0
    """Live requests holding device blocks after the step (neither waiting nor preempted), engine-wide."""
    num_waiting: int = 0
    """Live requests waiting for memory without having been preempted (the step could not give them
    the KV blocks they needed; they keep their place), engine-wide."""
    num_preempted: int = 0
    """Live requests waiting preempted after the step, engine-wide."""
    max_preempted_wait_s: float = 0.0
    """Longest current wait among requests still preempted after the step (0 when none)."""
    constrained_rows: int = 0
    """Sampled rows masked by a grammar in this step."""
    draft_tokens: int = 0
    """Speculative tokens verified in this step (``--speculate``)."""
    accepted_draft_tokens: int = 0
    """Of those, the ones accepted."""
    grammar_compile_s: tuple[float, ...] = ()
    """Durations of the grammar compiles that finished since the previous record."""
    grammar_cache_hits: int = 0
    """Grammar requests admitted since the previous record whose regex was already compiled."""
    part_s: tuple[tuple[str, float], ...] = ()
    """Step anatomy: ``(part, seconds)`` for parts of :data:`STEP_PARTS` (empty: not timed)."""
    memory: MemoryStats
    """Pool occupancy and waste right after the step."""
    lora: LoraUsage | None = None
    """Live requests per LoRA adapter right after the step (``None``: not counted)."""
    tiers: TierStats | None = None
    """The KV tiers below the pool right after the step, cumulative (``None``: no tier configured)."""
    batch_id: int | None = None
    """The router's batch the step ran for (Prefill, Decode); ``None`` for the engine's own steps (Warmup's,
    the liveness probe's), which no RPC span describes."""
    batch_requests: int = 0
    """Requests in that batch, preempted ones included (:attr:`batch_size` counts only the ones computed)."""

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase={self.phase!r} is invalid: allowed {PHASES}")
        for part, seconds in self.part_s:
            if part not in STEP_PARTS or seconds < 0:
                raise ValueError(f"step part {part!r}={seconds} is invalid: allowed {STEP_PARTS}, >= 0 s")
        for name in (
            "step_s",
            "batch_size",
            "tokens_computed",
            "tokens_recomputed",
            "blocks_allocated",
            "swap_out_bytes",
            "swap_in_bytes",
            "prefix_hit_tokens",
            "prefix_query_tokens",
            "image_tokens",
            "images_encoded",
            "num_running",
            "num_waiting",
            "num_preempted",
            "max_preempted_wait_s",
            "batch_requests",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: allowed >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRecord:
    """The pool and the live requests outside a step: after FilterBatch, ClearCache or a released batch."""

    memory: MemoryStats
    """Pool occupancy and waste now."""
    num_running: int
    num_preempted: int
    num_waiting: int
    """Live requests by state, as in :class:`StepRecord`."""
    lora: LoraUsage | None = None
    """Live requests per LoRA adapter (``None``: not counted)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBudget:
    """How device memory was split when the pool was sized (Warmup). All values in bytes."""

    device_total_bytes: int
    """Total memory of the device (``torch.cuda.mem_get_info``'s total; host RAM on CPU)."""
    weights_bytes: int
    """Model weights resident on this shard."""
    activation_peak_bytes: int
    """Peak activation memory measured while profiling the largest prefill."""
    pool_bytes: int
    """Physical KV pool (all layers, K and V)."""
    swap_bytes: int
    """CPU swap space reserved for swapped-out blocks (0 when swapping is off)."""
    lora_bytes: int = 0
    """LoRA adapters' A and B (``LORA_ADAPTERS``), part of :attr:`weights_bytes`."""

    def __post_init__(self) -> None:
        for name in (
            "device_total_bytes",
            "weights_bytes",
            "activation_peak_bytes",
            "pool_bytes",
            "swap_bytes",
            "lora_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: allowed >= 0")
