"""The bidirectional spans' arithmetic (``vision.attend_spans``): per-row key limits, where a prefill chunk may
end, the admission check, and the retention keys of a span with text in it."""

from __future__ import annotations

import numpy as np
import pytest

from tgi_paged_backend.vision.attend_spans import attend_limits, chunk_tokens, key_spans, longest_span_reason
from tgi_paged_backend.vision.image_keys import image_pseudo_id, keyed_token_ids

SPANS = (range(3, 8), range(10, 12))


def test_limits_reach_each_spans_end_and_stay_causal_elsewhere() -> None:
    assert attend_limits(SPANS, 0, 13).tolist() == [0, 1, 2, 7, 7, 7, 7, 7, 8, 9, 11, 11, 12]
    assert attend_limits(SPANS, 5, 2).tolist() == [7, 7]  # a chunk starting inside a span (a prefix hit)
    assert attend_limits(SPANS, 12, 4) is None and attend_limits((), 0, 5) is None
    assert attend_limits(SPANS, 8, 2) is None  # between the spans: causal, no limits at all


@pytest.mark.parametrize(
    ("start", "wanted", "room", "expected"),
    [
        (0, 3, 100, 3),  # ends at a span's start: as wanted
        (0, 5, 100, 3),  # would end inside the first span: ends before it
        (0, 8, 100, 8),  # ends at a span's stop
        (3, 2, 100, 5),  # starts at the span: the span goes whole past the wanted length
        (3, 2, 4, 0),  # ... unless the step has no room for it: wait
        (5, 1, 100, 3),  # starts inside (a prefix hit): the rest of the span
        (8, 3, 100, 2),  # would cut the second span: ends before it
        (0, 11, 100, 10),
        (12, 1, 1, 1),  # past every span
    ],
)
def test_chunks_never_end_inside_a_span(start, wanted, room, expected) -> None:
    n = chunk_tokens(SPANS, start, wanted, room)
    assert n == expected
    assert not any(s.start < start + n < s.stop for s in SPANS) or n == 0


def test_a_span_longer_than_the_budget_or_the_window_is_refused() -> None:
    assert longest_span_reason([range(0, 16)], 16) is None
    assert "prefill budget of 8" in (longest_span_reason([range(0, 16)], 8) or "")
    assert "sliding window (12)" in (longest_span_reason([range(0, 16)], 64, window=12) or "")
    assert longest_span_reason([], 1, window=1) is None


def test_a_text_span_is_keyed_by_all_of_it() -> None:
    """PaliGemma: the whole prompt is one span; its key changes with any token or image in it, so a retained block
    inside it is shared only by the same whole prompt; an image-only span (Gemma 3) keeps its image key."""
    ids = [5, 9, 9, 9, 6, 7]
    image_spans, images = [range(1, 4)], [b"red"]
    base = keyed_token_ids(ids, image_spans, images)
    whole = key_spans(base, ids, [range(0, 6)], image_spans, images)
    assert len(set(whole)) == 1 and whole[0] < 0
    assert key_spans(base, ids[:-1] + [8], [range(0, 6)], image_spans, images) != whole  # last token differs
    other = keyed_token_ids(ids, image_spans, [b"green"])
    assert key_spans(other, ids, [range(0, 6)], image_spans, [b"green"]) != whole  # another image
    assert key_spans(base, ids, image_spans, image_spans, images) == base == [5, *[image_pseudo_id(b"red")] * 3, 6, 7]
    assert np.all(np.asarray(whole) != image_pseudo_id(b"red"))
