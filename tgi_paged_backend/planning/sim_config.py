"""The simulation's budget and knobs (:class:`SimConfig`) and its step-time model (:class:`StepCostModel`),
shared by the allocators (:mod:`~tgi_paged_backend.planning.sim_allocators`) and the trace runner
(:mod:`~tgi_paged_backend.planning.allocator_sim`, whose docstring describes the model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tgi_paged_backend.config import PreemptionMode
from tgi_paged_backend.memory.window_reclaim import max_request_blocks
from tgi_paged_backend.policy.preemption_mode import RateCalibrator


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCostModel:
    """Seconds of one engine step: ``fixed + max(memory time, compute time) + swap copies``.

    memory time = (weights + KV bytes of every attended token) / bandwidth; compute time = FLOPs of
    every computed token / FLOP rate. :meth:`unit` (the default) makes every step last 1 s. A layer with a
    sliding window reads only its window (``kv_windows``, :meth:`attended_tokens`).
    """

    fixed_s: float = 1.0
    weights_bytes: float = 0.0
    kv_bytes_per_token: float = 0.0
    flops_per_token: float = 0.0
    mem_bytes_per_s: float = 1.0
    flops_per_s: float = 1.0
    swap_bytes_per_s: float = 25e9
    kv_windows: tuple[tuple[int | None, float], ...] = ()
    """Each attention window (``None``: full) with its share of ``kv_bytes_per_token``; ``()``: all full."""

    @classmethod
    def unit(cls) -> StepCostModel:
        return cls()

    def attended_tokens(self, num_positions: int) -> float:
        """Positions a request of ``num_positions`` reads per step, as full-attention equivalents (each
        windowed layer reads at most its window)."""
        if not self.kv_windows:
            return float(num_positions)
        return sum(share * (num_positions if w is None else min(num_positions, w)) for w, share in self.kv_windows)

    @property
    def is_unit(self) -> bool:
        return self.weights_bytes == 0 and self.flops_per_token == 0

    def step_s(self, *, context_tokens: float, computed_tokens: int, swap_bytes: int = 0) -> float:
        memory = (self.weights_bytes + self.kv_bytes_per_token * context_tokens) / self.mem_bytes_per_s
        compute = self.flops_per_token * computed_tokens / self.flops_per_s
        return self.fixed_s + max(memory, compute) + swap_bytes / self.swap_bytes_per_s

    def calibrator(self) -> RateCalibrator:
        """Rates for the swap-vs-recompute choice (policy defaults under the unit model)."""
        if self.is_unit:
            return RateCalibrator()
        return RateCalibrator(
            prefill_tokens_per_s=self.flops_per_s / self.flops_per_token, copy_bytes_per_s=self.swap_bytes_per_s
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """The budget and the knobs, shared by the three allocators."""

    num_blocks: int
    """Physical pool in blocks *including* block 0 (``TGI_PAGED_NUM_BLOCKS``); ``num_blocks - 1``
    are usable, for every allocator (stock TGI never hands out block 0 either)."""
    block_size: int = 16
    overcommit: float = 2.0
    """Paged only: the router's virtual pool is ``overcommit x`` the physical tokens."""
    max_prefill_tokens: int = 4096
    """Prompt tokens the router admits per step (``max_batch_prefill_tokens``); the shard's chunk budget."""
    max_batch_size: int | None = None
    watermark: float = 0.01
    preemption: PreemptionMode = "auto"
    """``auto``, ``recompute`` or ``swap`` (paged only)."""
    num_swap_blocks: int = 0
    """CPU swap blocks (paged only; 0 means recompute only)."""
    block_bytes: int = 0
    """Bytes of one block (swap cost); 0 makes swaps free in time."""
    max_preemptions: int = 8
    prefix_retention: bool = True
    reclaim_window: int | None = None
    """Paged only: the model's window when every layer is windowed (blocks behind it are given back)."""
    groups: tuple[int | None, ...] | None = None
    """Paged only, instead of ``reclaim_window``: each KV layer group's window (``None``: full attention),
    one page map per group over the pool (``KVCacheManager(groups=...)``; :mod:`~tgi_paged_backend.memory.
    layer_groups`). ``num_blocks`` are then blocks of one group's layers (see
    :mod:`~tgi_paged_backend.planning.allocator_sim`)."""
    budget_gain: float = 1.0
    """Paged only: the router's pool grows by it with layer groups
    (:attr:`~tgi_paged_backend.engine.capacity.Capacity.budget_gain`)."""
    cost: StepCostModel = field(default_factory=StepCostModel.unit)

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_size < 1 or self.overcommit < 1.0 or self.budget_gain < 1.0:
            raise ValueError(f"invalid simulation config {self}")
        if self.groups is not None and (not self.groups or self.reclaim_window is not None):
            raise ValueError(f"groups={self.groups}: at least one group, and not with reclaim_window")
        if self.usable_blocks < self.num_groups:
            raise ValueError(f"num_blocks={self.num_blocks}: fewer usable blocks than the {self.num_groups} groups")

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_groups(self) -> int:
        """KV layer groups (1 without :attr:`groups`)."""
        return 1 if self.groups is None else len(self.groups)

    @property
    def kv_tokens(self) -> int:
        """Usable physical token positions (the same budget for every allocator): with layer groups, those
        the pool holds when every group keeps every block."""
        return self.usable_blocks // self.num_groups * self.block_size

    def request_blocks(self, num_tokens: int) -> int:
        """Pool blocks one request of ``num_tokens`` positions holds at most (prefilled in one chunk):
        every group's, each sliding one about its window."""
        windows = self.groups if self.groups is not None else (self.reclaim_window,)
        return sum(max_request_blocks(num_tokens, self.block_size, w, num_tokens) for w in windows)
