"""Preemption summaries: counts by mode, one line per N events or T seconds, never a storm."""

from __future__ import annotations

import pytest
from telemetry_samples import sample_steps

from tgi_paged_backend.telemetry.log_throttle import PreemptionLogThrottle
from tgi_paged_backend.telemetry.recorder import NullRecorder, PreemptionLoggingRecorder
from tgi_paged_backend.telemetry.step_record import PreemptionRecord


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _event(mode: str, tokens: int = 16) -> PreemptionRecord:
    return PreemptionRecord(mode=mode, victim_id=1, tokens_lost=tokens, estimated_cost_s=0.01)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def lines() -> list[str]:
    return []


def test_first_event_logs_at_once_then_n_events_make_one_summary(clock, lines) -> None:
    throttle = PreemptionLogThrottle(every_events=10, interval_s=30, min_interval_s=1, clock=clock, log=lines.append)
    throttle.observe([_event("swap")])  # first after a quiet period: immediately
    assert len(lines) == 1 and "1 preemption(s)" in lines[0] and "swap=1" in lines[0]

    clock.now += 2
    for i in range(9):  # 9 pending: below N, within T -> nothing
        throttle.observe([_event("recompute" if i % 3 else "swap")])
    assert len(lines) == 1
    throttle.observe([_event("recompute", tokens=100)])  # the 10th -> one summary with counts by mode
    assert len(lines) == 2
    assert "10 preemption(s)" in lines[1] and "recompute=7, swap=3" in lines[1]
    assert "244 tokens moved off the device" in lines[1]
    assert "11 since start (recompute=7, swap=4)" in lines[1]
    assert throttle.num_pending == 0


def test_storm_is_limited_to_one_line_per_min_interval(clock, lines) -> None:
    throttle = PreemptionLogThrottle(every_events=10, interval_s=30, min_interval_s=1, clock=clock, log=lines.append)
    for _ in range(1000):  # 1000 events within 0.5 s
        throttle.observe([_event("recompute")])
        clock.now += 0.0005
    assert len(lines) == 1  # the first; the rest wait for min_interval_s
    clock.now += 1
    throttle.observe()
    assert len(lines) == 2 and "999 preemption(s)" in lines[1]


def test_pending_events_come_out_after_interval_or_at_flush(clock, lines) -> None:
    throttle = PreemptionLogThrottle(every_events=100, interval_s=30, min_interval_s=1, clock=clock, log=lines.append)
    throttle.observe([_event("swap")])
    clock.now += 5
    throttle.observe([_event("swap"), _event("recompute")])
    clock.now += 10
    assert throttle.observe() is None and len(lines) == 1
    clock.now += 20  # 30 s since the last summary: the 2 pending come out on an empty observe
    message = throttle.observe()
    assert message is not None and "2 preemption(s) in the last 30.0s (recompute=1, swap=1)" in message
    throttle.observe([_event("swap")])
    assert throttle.flush() is not None and len(lines) == 3
    assert throttle.flush() is None  # nothing pending


def test_logging_recorder_feeds_the_throttle(clock, lines) -> None:
    throttle = PreemptionLogThrottle(clock=clock, log=lines.append)
    recorder = PreemptionLoggingRecorder(NullRecorder(), throttle)
    for record in sample_steps():
        recorder.record_step(record)
    assert len(lines) == 1 and "recompute=1, swap=1" in lines[0]
    recorder.shutdown()


def test_invalid_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="every_events"):
        PreemptionLogThrottle(every_events=0)
    with pytest.raises(ValueError, match="min_interval_s"):
        PreemptionLogThrottle(interval_s=1, min_interval_s=5)
