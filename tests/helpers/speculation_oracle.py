"""Drafts from an oracle for speculative-decoding tests: the request's true continuation (known from a
reference run), with a wrong token planted every few drafts so that whole, partial and zero acceptance
all occur. Stands in for ``engine.speculation.ngram_draft``, whose drafts on tiny random models are
rarely right."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tgi_paged_backend.engine import speculation


class OracleDrafts:
    """``ngram_draft``'s signature: the next ``k`` tokens of the reference sequence ``history`` begins."""

    def __init__(self, sequences: Sequence[Sequence[int]], wrong_every: int = 3) -> None:
        self.sequences = [list(s) for s in sequences]
        self.wrong_every, self.calls = wrong_every, 0

    def __call__(self, history: Sequence[int], k: int, max_ngram: int = speculation.MAX_NGRAM) -> list[int]:
        history = list(history)
        for seq in self.sequences:
            if len(seq) > len(history) and seq[: len(history)] == history:
                draft = seq[len(history) : len(history) + k]
                self.calls += 1
                if draft and self.calls % self.wrong_every == 0:
                    draft[-1] = (draft[-1] + 1) % 300
                return draft
        return []


@contextmanager
def oracle_drafts(sequences: Sequence[Sequence[int]], wrong_every: int = 3) -> Iterator[OracleDrafts]:
    """Route the engine's proposer to an :class:`OracleDrafts` for the ``with`` block."""
    oracle, saved = OracleDrafts(sequences, wrong_every), speculation.ngram_draft
    speculation.ngram_draft = oracle  # type: ignore[assignment]
    try:
        yield oracle
    finally:
        speculation.ngram_draft = saved  # type: ignore[assignment]
