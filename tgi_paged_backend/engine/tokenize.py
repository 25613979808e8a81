"""Prompt tokenisation exactly as stock TGI does it.

Stock loads the tokenizer with ``truncation_side="left"`` and calls
``tokenizer(text, truncation=True, max_length=truncate, add_special_tokens=add_special_tokens)``. For a
tokenizer whose post-processor adds special tokens (Llama's BOS), HF truncation happens *before* they are
added: the result is ``[BOS] + last (truncate - 1) text tokens``, i.e. BOS is **kept** (checked in
``tests/engine/test_tokenize.py``). Plain "keep the last ``truncate`` ids" would drop BOS instead, so it is
only used when the tokenizer adds nothing.

To leave the caller's tokenizer untouched (HF stores the truncation side on the Python object and the
truncation parameters on the shared Rust tokenizer), :class:`PromptTokenizer` owns a private deep copy
with ``truncation_side="left"`` and serialises calls on it with a lock. Prompts that fit are tokenised
once; only over-long prompts go through HF's truncation path (so results are bit-identical to stock).

Deviation (degenerate case only): if HF returns more than ``truncate`` ids (``truncate`` smaller than the
number of special tokens the post-processor adds, where the Rust tokenizer silently skips truncation),
the last ``truncate`` ids are kept, so the result never exceeds what the router budgeted for.
``truncate`` of ``None`` or ``<= 0`` means no truncation (HF treats ``max_length=0`` that way).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["PromptTokenizer"]


class PromptTokenizer:
    """Thread-safe prompt tokenisation with stock's left truncation, on a private tokenizer copy."""

    def __init__(self, tokenizer) -> None:
        self._tok = copy.deepcopy(tokenizer)
        self._tok.truncation_side = "left"
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        """The private copy (do not change its settings)."""
        return self._tok

    def _call(self, texts: list[str], *, truncate: int | None, add_special_tokens: bool) -> list[list[int]]:
        kwargs: dict[str, Any] = {"add_special_tokens": add_special_tokens, "verbose": False}
        if truncate:
            kwargs.update(truncation=True, max_length=truncate)
        else:
            kwargs.update(truncation=False)
        with self._lock:
            out = self._tok(texts, **kwargs)["input_ids"]
        return [list(ids) for ids in out]

    def encode(self, text: str, truncate: int | None, add_special_tokens: bool = True) -> list[int]:
        """Prompt ids of one request (at most ``truncate`` of them when ``truncate > 0``)."""
        return self.encode_batch([text], [truncate], [add_special_tokens])[0]

    def encode_batch(
        self, texts: Sequence[str], truncates: Sequence[int | None], add_special_tokens: Sequence[bool] | bool = True
    ) -> list[list[int]]:
        """Prompt ids of many requests: one untruncated batch call per ``add_special_tokens`` value, then
        HF's own left truncation for the prompts that are too long."""
        n = len(texts)
        if isinstance(add_special_tokens, bool):
            add_special_tokens = [add_special_tokens] * n
        if len(truncates) != n or len(add_special_tokens) != n:
            raise ValueError("texts, truncates and add_special_tokens must have the same length")
        result: list[list[int] | None] = [None] * n
        for flag in (True, False):
            idx = [i for i in range(n) if bool(add_special_tokens[i]) is flag]
            if not idx:
                continue
            full = self._call([texts[i] for i in idx], truncate=None, add_special_tokens=flag)
            for i, row in zip(idx, full):
                result[i] = row
        out: list[list[int]] = []
        for i, ids in enumerate(result):
            assert ids is not None  # every index is in one of the two add_special_tokens groups
            t = truncates[i]
            if t and t > 0 and len(ids) > t:
                ids = self._call([texts[i]], truncate=t, add_special_tokens=bool(add_special_tokens[i]))[0]
                if len(ids) > t:
                    ids = ids[-t:]
            out.append(ids)
        return out

    def encode_requests(self, requests) -> list[list[int]]:
        """:meth:`encode_batch` over ``RequestSpec``-like objects (``text``, ``truncate``,
        ``add_special_tokens``)."""
        reqs = list(requests)
        return self.encode_batch(
            [r.text for r in reqs], [r.truncate for r in reqs], [r.add_special_tokens for r in reqs]
        )
