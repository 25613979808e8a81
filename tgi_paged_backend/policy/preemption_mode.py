"""Swap or recompute: a per-victim cost model calibrated from measured rates.

- recompute: ``tokens_to_reprefill / prefill_tokens_per_s`` (the victim's prompt + generated tokens
  are prefilled again on resume).
- swap: ``2 * bytes / copy_bytes_per_s`` (out now, in on resume), possible only while the CPU swap
  space has room.

``auto`` picks the cheaper; ``swap`` falls back to recompute without room; ``recompute`` always
recomputes. Rates are exponential moving averages of what the runner measures (prefill steps and
block copies), starting from conservative defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tgi_paged_backend.config import PreemptionMode

DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
"""Initial prefill throughput guess (a small GPU model; CPU runs calibrate down within a few steps)."""
DEFAULT_COPY_BYTES_PER_S = 10e9
"""Initial device<->host copy bandwidth guess (pinned PCIe 4.0 x16 moves about 20-25 GB/s)."""


@dataclass(slots=True)
class RateCalibrator:
    """Exponential moving averages of measured prefill and copy rates.

    Attributes:
        prefill_tokens_per_s: Prefill throughput estimate.
        copy_bytes_per_s: One-direction swap bandwidth estimate.
        alpha: Weight of each new measurement, in ``(0, 1]``.
    """

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    copy_bytes_per_s: float = DEFAULT_COPY_BYTES_PER_S
    alpha: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha} is invalid: allowed (0, 1]")
        if self.prefill_tokens_per_s <= 0 or self.copy_bytes_per_s <= 0:
            raise ValueError("initial rates must be > 0")

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Fold in one prefill measurement (ignored when empty or not timed)."""
        if num_tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s += self.alpha * (num_tokens / seconds - self.prefill_tokens_per_s)

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        """Fold in one block-copy measurement (ignored when empty or not timed)."""
        if num_bytes > 0 and seconds > 0:
            self.copy_bytes_per_s += self.alpha * (num_bytes / seconds - self.copy_bytes_per_s)


@dataclass(frozen=True, slots=True)
class PreemptionDecision:
    """How to preempt one victim, with the estimates behind the choice."""

    mode: Literal["recompute", "swap"]
    recompute_cost_s: float
    swap_cost_s: float | None
    """``None`` when swapping is not possible (no swap-space room)."""


def recompute_cost_s(num_tokens: int, calibrator: RateCalibrator) -> float:
    """Seconds to prefill ``num_tokens`` again."""
    return num_tokens / calibrator.prefill_tokens_per_s


def swap_cost_s(num_bytes: int, calibrator: RateCalibrator) -> float:
    """Seconds to copy ``num_bytes`` out and back in."""
    return 2 * num_bytes / calibrator.copy_bytes_per_s


def choose_preemption_mode(
    mode: PreemptionMode,
    *,
    num_tokens_to_reprefill: int,
    num_swap_bytes: int,
    swap_has_room: bool,
    calibrator: RateCalibrator,
) -> PreemptionDecision:
    """Pick swap or recompute for one victim.

    Args:
        mode: ``auto``, ``recompute`` or ``swap`` (``TGI_PAGED_PREEMPTION``).
        num_tokens_to_reprefill: Tokens a recompute would prefill again on resume.
        num_swap_bytes: K/V bytes of the victim's blocks (all layers, K and V).
        swap_has_room: Whether the swap space can take the victim now.
        calibrator: Current rate estimates.
    """
    recompute = recompute_cost_s(num_tokens_to_reprefill, calibrator)
    swap = swap_cost_s(num_swap_bytes, calibrator) if swap_has_room else None
    if swap is None or mode == "recompute":
        chosen: Literal["recompute", "swap"] = "recompute"
    elif mode == "swap":
        chosen = "swap"
    else:
        chosen = "swap" if swap < recompute else "recompute"
    return PreemptionDecision(chosen, recompute, swap)
