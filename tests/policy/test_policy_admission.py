"""Admission brake: when to brake, and the CachedBatch figures that make the router stop."""

from __future__ import annotations

from tgi_paged_backend.policy.admission import BatchTokens, reported_batch_tokens, should_brake


def test_brakes_below_the_watermark_share_of_free_blocks() -> None:
    # 1000 blocks, watermark 1 %: at least 10 free blocks keep admissions open.
    assert not should_brake(10, 1000, 0.01, 0)
    assert should_brake(9, 1000, 0.01, 0)
    assert not should_brake(1000, 1000, 0.01, 0)


def test_brakes_while_preempted_requests_wait_even_with_room() -> None:
    assert should_brake(900, 1000, 0.01, 1)


def test_zero_watermark_still_brakes_on_an_empty_pool() -> None:
    assert not should_brake(1, 1000, 0.0, 0)
    assert should_brake(0, 1000, 0.0, 0)


def test_reports_true_figures_when_not_braking() -> None:
    assert reported_batch_tokens(
        braking=False, max_tokens=300, current_tokens=40, max_batch_total_tokens=10_000, max_batch_prefill_tokens=4096
    ) == BatchTokens(300, 40)


def test_braking_fills_the_routers_budget() -> None:
    # The router admits only while max_batch_total_tokens - max_tokens > 0.
    assert reported_batch_tokens(
        braking=True, max_tokens=300, current_tokens=40, max_batch_total_tokens=10_000
    ) == BatchTokens(10_000, 40)
    # With chunking, the prefill budget max_batch_prefill_tokens - current_tokens is exhausted too.
    assert reported_batch_tokens(
        braking=True, max_tokens=300, current_tokens=40, max_batch_total_tokens=10_000, max_batch_prefill_tokens=4096
    ) == BatchTokens(10_000, 4096)
    # Larger true values are never lowered.
    assert reported_batch_tokens(
        braking=True,
        max_tokens=12_000,
        current_tokens=5000,
        max_batch_total_tokens=10_000,
        max_batch_prefill_tokens=4096,
    ) == BatchTokens(12_000, 5000)
