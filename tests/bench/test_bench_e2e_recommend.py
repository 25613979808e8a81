"""The end-to-end bench's overcommit recommendation rule (a pure function of the measured runs)."""

from __future__ import annotations

from integration.bench_e2e import ModeResult, recommend


def _run(overcommit: float, tokens_per_s: float, waste: float, recomputed: int = 0) -> ModeResult:
    return ModeResult(
        mode="paged",
        overcommit=overcommit,
        wall_s=10.0,
        useful_tokens=100,
        tokens_per_s=tokens_per_s,
        requests_per_s=1.0,
        ttft_p50_s=1.0,
        ttft_p99_s=2.0,
        itl_p50_s=0.1,
        itl_p99_s=0.2,
        peak_admitted=4,
        peak_running=4,
        mean_batch=3.0,
        preemptions={"recompute": 0, "swap": 0},
        recomputed_tokens=recomputed,
        computed_tokens=1000,
        waste_internal=0.0,
        waste_reservation=0.0,
        waste_external=waste,
        idle_queued=0.0,
        virtual_unbacked=0.0,
        kv_used=0.5,
        setup_s=1.0,
        pool_tokens=512,
    )


def test_smallest_overcommit_near_best_throughput_and_lowest_waste():
    runs = [_run(3, 20.0, 0.11), _run(6, 23.5, 0.025), _run(8, 24.0, 0.020)]
    # 6 is within 5 % of the best tokens/s and 1 point of the lowest waste
    assert recommend(runs)[0] == 6
    # waste decides when throughput ties: 3 is fast enough but wastes 9 points more
    assert recommend([_run(3, 24.0, 0.11), _run(8, 24.0, 0.02)])[0] == 8


def test_when_no_run_meets_both_waste_decides_then_throughput():
    # 4 is fastest but wastes 4 points more; of 6 and 8 (both lean) 6 is faster
    runs = [_run(3, 24.2, 0.112), _run(4, 26.9, 0.060), _run(6, 25.1, 0.018), _run(8, 23.0, 0.019)]
    overcommit, why = recommend(runs)
    assert overcommit == 6 and why.startswith("no run met both tolerances")


def test_runs_over_the_recompute_tax_are_left_out_unless_all_are():
    heavy = _run(8, 30.0, 0.01, recomputed=200)  # tax 20 %
    assert recommend([_run(4, 24.0, 0.02), heavy])[0] == 4
    assert recommend([heavy])[0] == 8


def test_no_paged_run():
    assert recommend([]) == (None, "no paged run")
