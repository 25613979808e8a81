"""Request states as the telemetry counts them: running, waiting for memory, preempted (disjoint)."""

from __future__ import annotations

from tgi_paged_backend.engine.request_state import RequestState, RequestStatus
from tgi_paged_backend.engine.types import RequestSpec, StoppingParams


def _state() -> RequestState:
    spec = RequestSpec(id=1, text="hi", truncate=100, stopping=StoppingParams(max_new_tokens=4))
    return RequestState(spec=spec, prompt_ids=[5, 6, 7], admitted_seq=0)


def test_blocked_request_is_waiting_not_running_and_preempted_is_not_waiting():
    r = _state()
    assert not r.is_waiting and not r.is_preempted
    r.waiting_for_blocks = True
    assert r.is_waiting
    r.waiting_for_blocks = False
    r.num_computed = 3
    r.mark_preempted(RequestStatus.PREEMPTED)
    assert r.is_preempted and not r.is_waiting  # a real preemption
    r.mark_resumed()
    r.waiting_for_blocks = True
    r.mark_preempted(RequestStatus.SWAPPED)
    assert not r.is_waiting  # swapped: counted as preempted, whatever the stale flag says


def test_new_request_that_gave_back_shared_prefix_blocks_is_waiting():
    r = _state()
    r.num_computed = r.num_cached_prompt = 2  # matched two retained prompt tokens, computed nothing of its own
    r.mark_waiting()
    assert r.is_preempted and r.is_waiting and r.num_preemptions == 0
