"""What one simulated run reports (:class:`SimResult`), the three allocators side by side on one trace
(:class:`Comparison`), and the overcommit advice over a sweep (:func:`advise_overcommit`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class SimResult:
    """What one allocator did with one trace."""

    allocator: str
    overcommit: float
    num_requests: int
    finished: int
    failed: int
    """OOM-equivalent: reservation can never fit the budget."""
    steps: int
    sim_time_s: float
    generated_tokens: int
    tokens_per_s: float
    requests_per_s: float
    mean_running: float
    """Time-averaged requests computing per step (the batch size)."""
    peak_running: int
    mean_admitted: float
    """Time-averaged requests admitted and not finished (running + preempted/waiting)."""
    peak_admitted: int
    mean_queued: float
    peak_queued: int
    waste_internal: float
    """Fractions of the usable physical pool, time-averaged."""
    waste_reservation: float
    waste_external: float
    kv_used: float
    """Fraction of the pool holding written K/V, time-averaged."""
    virtual_unbacked: float
    """Paged only: router-reserved slots with no physical block, as a fraction of the pool."""
    fragmentation_steps: int
    admit_refusals: int
    """Steps where the FIFO head did not fit the allocator (paged: the router's virtual pool)."""
    preemptions_recompute: int
    preemptions_swap: int
    recomputed_tokens: int
    computed_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    latency_mean_s: float
    series: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @property
    def waste_total(self) -> float:
        return self.waste_internal + self.waste_reservation + self.waste_external

    @property
    def preemptions(self) -> int:
        return self.preemptions_recompute + self.preemptions_swap

    @property
    def recompute_tax(self) -> float:
        """Recomputed tokens over all computed tokens."""
        return self.recomputed_tokens / self.computed_tokens if self.computed_tokens else 0.0

    def to_dict(self, *, series: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not series:
            out.pop("series")
        out.update(waste_total=self.waste_total, preemptions=self.preemptions, recompute_tax=self.recompute_tax)
        return out


@dataclass(slots=True)
class Comparison:
    """Contiguous, stock and paged (at each overcommit) on one trace and budget."""

    contiguous: SimResult
    stock: SimResult
    paged: dict[float, SimResult]
    chosen_overcommit: float

    @property
    def best(self) -> SimResult:
        return self.paged[self.chosen_overcommit]

    def to_dict(self, *, series: bool = False) -> dict[str, Any]:
        return {
            "contiguous": self.contiguous.to_dict(series=series),
            "stock": self.stock.to_dict(series=series),
            "paged": {str(k): v.to_dict(series=series) for k, v in self.paged.items()},
            "chosen_overcommit": self.chosen_overcommit,
        }


DEFAULT_OVERCOMMITS: tuple[float, ...] = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
MAX_RECOMPUTE_TAX = 0.10
THROUGHPUT_TOLERANCE = 0.03
WASTE_TOLERANCE = 0.01


def advise_overcommit(
    paged: dict[float, SimResult],
    *,
    max_recompute_tax: float = MAX_RECOMPUTE_TAX,
    tolerance: float = THROUGHPUT_TOLERANCE,
    waste_tolerance: float = WASTE_TOLERANCE,
) -> float:
    """The smallest overcommit that gives up nothing that matters.

    Among the runs with no failure and a recompute tax of at most ``max_recompute_tax`` (all runs if
    none qualifies): the smallest overcommit whose throughput is within ``tolerance`` of the best and
    whose KV waste is within ``waste_tolerance`` (absolute) of the lowest; when none is within both,
    the fastest of those within the waste tolerance. A smaller overcommit means fewer preemptions and
    less exposure to long answers; a larger one buys nothing here.
    """
    ok = {k: v for k, v in paged.items() if v.recompute_tax <= max_recompute_tax and v.failed == 0} or paged
    return pick_overcommit(
        {k: (v.tokens_per_s, v.waste_total) for k, v in ok.items()},
        tolerance=tolerance,
        waste_tolerance=waste_tolerance,
    )


def pick_overcommit(runs: dict[float, tuple[float, float]], *, tolerance: float, waste_tolerance: float) -> float:
    """The overcommit rule on ``{overcommit: (tokens/s, waste share)}`` of the eligible runs (shared by
    the simulation's advice and the end-to-end bench's recommendation): the smallest overcommit within
    ``tolerance`` of the best tokens/s and ``waste_tolerance`` (absolute) of the lowest waste; when none
    is within both, the fastest of those within the waste tolerance."""
    best = max(tps for tps, _ in runs.values())
    least_waste = min(waste for _, waste in runs.values())
    lean = {k: tps for k, (tps, waste) in runs.items() if waste <= least_waste + waste_tolerance}
    good = [k for k, tps in lean.items() if tps >= (1 - tolerance) * best]
    return min(good) if good else max(lean, key=lean.__getitem__)
