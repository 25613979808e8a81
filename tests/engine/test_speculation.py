"""The speculation policies (``engine.speculation``): the n-gram proposer, who drafts, and acceptance."""

from __future__ import annotations

from tgi_paged_backend.engine.request_state import RequestState, RequestStatus
from tgi_paged_backend.engine.speculation import (
    accepted_prefix,
    drafting_pays,
    may_speculate,
    ngram_draft,
    propose_drafts,
)
from tgi_paged_backend.engine.types import GrammarSpec, RequestSpec, SamplingParams, StoppingParams


def test_ngram_draft_follows_the_latest_occurrence_of_the_longest_suffix() -> None:
    # suffix (7, 8, 9) recurs at 0 and at 6: the latest one's continuation (5, 5) wins over (1, 2)
    history = [7, 8, 9, 1, 2, 3, 7, 8, 9, 5, 5, 0, 7, 8, 9]
    assert ngram_draft(history, 2) == [5, 5]
    assert ngram_draft(history, 9) == [5, 5, 0, 7, 8, 9]  # up to the end of history
    # no 3- or 2-gram recurs, the last token does: its latest continuation
    assert ngram_draft([4, 1, 4, 2, 6, 4], 3) == [2, 6, 4]
    assert ngram_draft([1, 2, 3], 4) == []  # nothing recurs
    assert ngram_draft([5, 5], 0) == [] and ngram_draft([5], 3) == []
    # a longer match beats a later shorter one: (2, 3) -> 9 rather than 3 -> 4
    assert ngram_draft([2, 3, 9, 3, 4, 1, 2, 3], 1) == [9]


def test_accepted_prefix_counts_confirmed_leading_tokens() -> None:
    assert accepted_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted_prefix([1, 2, 3], [1, 5, 3, 4]) == 1
    assert accepted_prefix([1, 2], [0, 2, 9]) == 0
    assert accepted_prefix([], [7]) == 0


def _state(output: list[int], max_new: int = 10, **sampling) -> RequestState:
    spec = RequestSpec(
        id=1,
        text="",
        truncate=100,
        sampling=SamplingParams(**sampling),
        stopping=StoppingParams(max_new_tokens=max_new),
    )
    r = RequestState(spec=spec, prompt_ids=[3, 4, 3, 4], admitted_seq=1, output_ids=list(output))
    r.num_computed, r.prefill_done = r.num_tokens - 1, True
    return r


def test_who_drafts_and_how_far() -> None:
    r = _state([3])
    assert may_speculate(r)
    assert propose_drafts([r], 4) == 2 and r.draft == [4, 3]  # history 3 4 3 4 3: "3 4 3" at 0 continues "4 3"
    assert propose_drafts([r], 0) == 0 and r.draft == []
    near_end = _state([3], max_new=3)  # one more token is verified after the draft: room for 1
    propose_drafts([near_end], 4)
    assert len(near_end.draft) == 1
    assert not may_speculate(_state([3], grammar=GrammarSpec("regex", "[0-9]+")))  # its automaton is not set up
    assert may_speculate(_state([3], repetition_penalty=1.2))  # each position's history holds the draft before it
    assert not may_speculate(_state([]))  # the first token comes from the prefill
    preempted = _state([3])
    preempted.status = RequestStatus.PREEMPTED
    prefilling = _state([3])
    prefilling.num_computed = 2
    assert not may_speculate(preempted) and not may_speculate(prefilling)


def test_medusa_drafts_come_from_the_pending_proposal() -> None:
    r = _state([3], max_new=4)
    r.proposal = [9, 8, 7]
    assert propose_drafts([r], 3, medusa=True) == 2 and r.draft == [9, 8]  # room for 2 before max_new_tokens
    assert propose_drafts([r], 1, medusa=True) == 1 and r.draft == [9]
    r.proposal = []
    assert propose_drafts([r], 3, medusa=True) == 0 and r.draft == []


def test_drafting_in_batched_decode_steps_only_up_to_the_limit() -> None:
    decoding = [_state([3]) for _ in range(3)]
    assert drafting_pays(decoding, None) and drafting_pays(decoding, 3)
    assert not drafting_pays(decoding, 2) and drafting_pays(decoding[:1], 1)
    prefilling = _state([3])
    prefilling.num_computed = 2  # its prompt is still being computed: the step takes the multi-position path
    assert drafting_pays([*decoding, prefilling], 1)
    prefilling.status = RequestStatus.PREEMPTED  # not in the step's forward
    assert not drafting_pays([*decoding, prefilling], 1)
