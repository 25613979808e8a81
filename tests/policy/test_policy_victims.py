"""Victim order (latest admitted first / cheapest first), protection, and resume order."""

from __future__ import annotations

from tgi_paged_backend.policy.victims import VictimCandidate, pick_victims, resume_order, victim_order


def cand(request_id: int, seq: int, blocks: int = 1, preemptions: int = 0, cost: float = 0.0) -> VictimCandidate:
    return VictimCandidate(request_id, seq, preemptions, blocks, cost)


def ids(candidates: list[VictimCandidate] | None) -> list[int] | None:
    return None if candidates is None else [c.request_id for c in candidates]


RUNNING = [
    cand(10, 1, blocks=4, cost=0.5),
    cand(11, 2, blocks=2, cost=0.1),
    cand(12, 3, blocks=1, cost=0.3),
    cand(13, 4, blocks=3, cost=0.1),
]


def test_latest_admitted_is_preempted_first() -> None:
    assert ids(victim_order(RUNNING, max_preemptions=8)) == [13, 12, 11, 10]


def test_requests_preempted_too_often_are_protected() -> None:
    running = [*RUNNING[:3], cand(13, 4, blocks=3, preemptions=8)]
    assert ids(victim_order(running, max_preemptions=8)) == [12, 11, 10]


def test_cost_aware_order_is_cheapest_first_ties_latest_first() -> None:
    assert ids(victim_order(RUNNING, max_preemptions=8, cost_aware=True)) == [13, 11, 12, 10]


def test_pick_victims_stops_once_enough_blocks_are_freed() -> None:
    assert ids(pick_victims(RUNNING, 4, max_preemptions=8)) == [13, 12]
    assert ids(pick_victims(RUNNING, 0, max_preemptions=8)) == []
    assert ids(pick_victims(RUNNING, 5, max_preemptions=8, cost_aware=True)) == [13, 11]


def test_pick_victims_says_none_when_even_all_would_not_do() -> None:
    assert pick_victims(RUNNING, 11, max_preemptions=8) is None
    assert ids(pick_victims(RUNNING, 10, max_preemptions=8)) == [13, 12, 11, 10]


def test_resume_order_is_oldest_admitted_first() -> None:
    assert ids(resume_order([cand(5, 9), cand(6, 2), cand(7, 4)])) == [6, 7, 5]
