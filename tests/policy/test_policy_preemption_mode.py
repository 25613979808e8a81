"""Swap vs recompute cost model and the rate calibrator."""

from __future__ import annotations

import pytest

from tgi_paged_backend.policy.preemption_mode import (
    PreemptionDecision,
    RateCalibrator,
    choose_preemption_mode,
    recompute_cost_s,
    swap_cost_s,
)

RATES = RateCalibrator(prefill_tokens_per_s=1000.0, copy_bytes_per_s=1e6)


def test_costs_follow_the_formulas() -> None:
    assert recompute_cost_s(500, RATES) == pytest.approx(0.5)
    assert swap_cost_s(100_000, RATES) == pytest.approx(0.2)  # out and back in


def test_auto_picks_the_cheaper_mode() -> None:
    # 500 tokens to recompute (0.5 s) vs 100 kB to move twice (0.2 s): swap.
    assert choose_preemption_mode(
        "auto", num_tokens_to_reprefill=500, num_swap_bytes=100_000, swap_has_room=True, calibrator=RATES
    ) == PreemptionDecision("swap", pytest.approx(0.5), pytest.approx(0.2))
    # 100 tokens (0.1 s) vs 0.2 s: recompute.
    assert (
        choose_preemption_mode(
            "auto", num_tokens_to_reprefill=100, num_swap_bytes=100_000, swap_has_room=True, calibrator=RATES
        ).mode
        == "recompute"
    )


def test_swap_needs_room_and_falls_back_to_recompute() -> None:
    decision = choose_preemption_mode(
        "swap", num_tokens_to_reprefill=10**6, num_swap_bytes=1, swap_has_room=False, calibrator=RATES
    )
    assert decision.mode == "recompute" and decision.swap_cost_s is None
    assert (
        choose_preemption_mode(
            "swap", num_tokens_to_reprefill=1, num_swap_bytes=10**9, swap_has_room=True, calibrator=RATES
        ).mode
        == "swap"
    )


def test_recompute_mode_never_swaps() -> None:
    assert (
        choose_preemption_mode(
            "recompute", num_tokens_to_reprefill=10**6, num_swap_bytes=1, swap_has_room=True, calibrator=RATES
        ).mode
        == "recompute"
    )


def test_calibrator_moves_toward_measurements() -> None:
    rates = RateCalibrator(prefill_tokens_per_s=1000.0, copy_bytes_per_s=1e9, alpha=0.5)
    rates.observe_prefill(3000, 1.0)  # measured 3000 tok/s
    assert rates.prefill_tokens_per_s == pytest.approx(2000.0)
    rates.observe_copy(int(2e9), 0.5)  # measured 4 GB/s
    assert rates.copy_bytes_per_s == pytest.approx(2.5e9)
    rates.observe_prefill(0, 1.0)  # empty or untimed measurements are ignored
    rates.observe_copy(10, 0.0)
    assert (rates.prefill_tokens_per_s, rates.copy_bytes_per_s) == (pytest.approx(2000.0), pytest.approx(2.5e9))


def test_defaults_are_sane_and_alpha_is_validated() -> None:
    rates = RateCalibrator()
    assert rates.prefill_tokens_per_s > 0 and rates.copy_bytes_per_s > 0
    with pytest.raises(ValueError, match="alpha"):
        RateCalibrator(alpha=0.0)
