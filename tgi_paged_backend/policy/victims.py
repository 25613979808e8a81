"""Victim and resume order for preemption (pure functions over small request views).

Default order is vLLM's: the most recently admitted running request is preempted first, so the
oldest requests keep making progress. The cost-aware order preempts the cheapest estimated
preemption first (ties: latest admitted first). A request preempted ``max_preemptions`` times is
protected (never chosen again), which bounds how often one request can be starved.

Resume order: preempted requests come back oldest-admitted first, before any new admission.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class VictimCandidate:
    """What the policy needs to know about one running request."""

    request_id: int
    admission_seq: int
    """Monotonic admission counter: larger means admitted later."""
    num_preemptions: int
    """Times this request has been preempted so far."""
    num_freeable_blocks: int
    """Blocks preempting it gives back to the pool (shared blocks excluded)."""
    estimated_cost_s: float = 0.0
    """Estimated preemption cost (see ``policy.preemption_mode``); used by the cost-aware order."""


def victim_order(
    candidates: Iterable[VictimCandidate], *, max_preemptions: int, cost_aware: bool = False
) -> list[VictimCandidate]:
    """Candidates in the order they should be preempted, protected requests left out.

    Args:
        candidates: Running requests that may be preempted.
        max_preemptions: Requests preempted this many times are protected.
        cost_aware: Order by ``estimated_cost_s`` (cheapest first) instead of latest admitted first.
    """
    eligible = [c for c in candidates if c.num_preemptions < max_preemptions]
    if cost_aware:
        return sorted(eligible, key=lambda c: (c.estimated_cost_s, -c.admission_seq))
    return sorted(eligible, key=lambda c: -c.admission_seq)


def pick_victims(
    candidates: Iterable[VictimCandidate], num_blocks_needed: int, *, max_preemptions: int, cost_aware: bool = False
) -> list[VictimCandidate] | None:
    """The shortest prefix of :func:`victim_order` that frees ``num_blocks_needed`` blocks.

    Returns:
        The victims in preemption order (empty when nothing is needed), or ``None`` when preempting
        every eligible candidate would still not free enough.
    """
    chosen: list[VictimCandidate] = []
    freed = 0
    for candidate in victim_order(candidates, max_preemptions=max_preemptions, cost_aware=cost_aware):
        if freed >= num_blocks_needed:
            break
        chosen.append(candidate)
        freed += candidate.num_freeable_blocks
    return chosen if freed >= num_blocks_needed else None


def resume_order(preempted: Iterable[VictimCandidate]) -> list[VictimCandidate]:
    """Preempted requests in the order they should resume: oldest admitted first."""
    return sorted(preempted, key=lambda c: c.admission_seq)
