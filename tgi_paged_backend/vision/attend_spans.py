"""Bidirectional spans of a prompt: the attention limits, chunk boundaries and retention keys they need.

Gemma 3 lets the tokens of one image attend to each other both ways (text stays causal); PaliGemma's prompt is
a prefix-LM prefix: every prompt token (image placeholders, ``<bos>``, text, the closing ``\\n``) attends to the
whole prompt, and generated tokens are causal. Both are *spans* of prompt positions (``range``, disjoint, in
order) inside which a token sees every other. The paged attention takes them as one limit per packed row
(:func:`attend_limits`): token ``i`` attends to keys ``j <= max(i, span_end(i))``, where a causal token's limit
is itself; the sliding window still counts back from ``i`` (transformers: ``AND(window, OR(causal, span))``).

Three consequences, one function each:

- a token's limit reaches keys after it, so a prefill chunk must hold the rest of every span it touches: a
  chunk whose end would fall inside a span ends before it instead, or, when it starts at (or inside, after a
  prefix hit) the span, takes the span whole if the step has room, else the request waits a step
  (:func:`chunk_tokens`); a span longer than the prefill budget could never run and is refused at admission
  (:func:`longest_span_reason`);
- a retained block inside a span holds K/V computed with the *whole* span visible, so its prefix key must
  name the whole span: image spans are keyed by the image's bytes already (:mod:`.image_keys`); a span
  with text in it (PaliGemma's prompt) is keyed by a digest of everything in it (:func:`key_spans`);
- decode steps and text-only chunks carry no limits (causal as before).
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np

from tgi_paged_backend.vision.image_keys import PSEUDO_ID_FLOOR

_PSEUDO_ID_SPAN = 2**62


def attend_limits(spans: Sequence[range], start: int, count: int) -> np.ndarray | None:
    """int64 ``[count]``: the last key position each of positions ``start .. start + count`` attends to (its span's
    last position inside a span, else itself); ``None`` when no span touches them (causal rows only)."""
    limits: np.ndarray | None = None
    for span in spans:
        lo, hi = max(span.start, start), min(span.stop, start + count)
        if lo < hi:
            if limits is None:
                limits = np.arange(start, start + count, dtype=np.int64)
            limits[lo - start : hi - start] = span.stop - 1
    return limits


def chunk_tokens(spans: Sequence[range], start: int, wanted: int, room: int) -> int:
    """Tokens a prefill chunk from ``start`` computes when ``wanted`` would be the scheduler's choice.

    ``wanted`` when its end is not strictly inside a span; else the chunk ends at the span's start when that
    leaves it tokens, or (the chunk starts at or inside the span) takes the span whole when the rest of it,
    from ``start``, fits ``room``; else 0: the request waits for a step with room.
    """
    end = start + wanted
    for span in spans:
        if span.start < end < span.stop:
            if span.start > start:
                return span.start - start
            return span.stop - start if span.stop - start <= room else 0
    return wanted


def longest_span_reason(spans: Sequence[range], max_prefill_tokens: int, window: int | None = None) -> str | None:
    """Why a request with these spans cannot be served, or ``None``: a span goes whole into one chunk, so one
    longer than the step budget ``max_prefill_tokens`` could never be prefilled; ``window``: the family's spans
    see past its sliding layers' window (PaliGemma 2 in transformers: ``OR(AND(causal, window), prefix)``), which
    the per-row limits (and the sliding layers' reclaimed blocks) do not give, so a span must fit the window."""
    longest = max((len(span) for span in spans), default=0)
    if window is not None and longest > window:
        return (
            f"a prefix-LM prompt of {longest} tokens is longer than the sliding window ({window}) of the language "
            "model: its prefix attends past the window, which the paged attention does not serve"
        )
    if longest <= max_prefill_tokens:
        return None
    return (
        f"a bidirectional span of {longest} tokens (an image's, or a prefix-LM prompt's) must be prefilled in one "
        f"chunk, longer than the prefill budget of {max_prefill_tokens} tokens (max_batch_prefill_tokens)"
    )


def span_pseudo_id(token_ids: Sequence[int], images: Sequence[bytes]) -> int:
    """The negative id every position of a span holding ``token_ids`` and ``images`` is keyed by."""
    digest = blake2b(b"tgi-paged-span", digest_size=8)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    for data in images:
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return -(PSEUDO_ID_FLOOR + int.from_bytes(digest.digest(), "little") % _PSEUDO_ID_SPAN)


def key_spans(
    keys: Sequence[int],
    token_ids: Sequence[int],
    spans: Sequence[range],
    image_spans: Sequence[range],
    images: Sequence[bytes],
) -> list[int]:
    """``keys`` (the prompt's retention keys, images keyed by their bytes) with every span that is not exactly
    one image's placeholders keyed as a whole: its positions all get :func:`span_pseudo_id` of its token ids and
    the bytes of the images inside it, so a retained block inside it is shared only by the same whole span."""
    keyed = list(keys)
    for span in spans:
        if span in image_spans:
            continue
        inside = [
            data for image, data in zip(image_spans, images) if image.start < span.stop and image.stop > span.start
        ]
        pseudo = span_pseudo_id(token_ids[span.start : span.stop], inside)
        keyed[span.start : span.stop] = [pseudo] * len(span)
    return keyed
