"""Prompts of exactly the trace's lengths for any tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tgi_paged_backend.planning.workload import TraceRequest


def build_prompts(tokenizer: Any, trace: Sequence[TraceRequest], seed: int = 0) -> list[str]:
    """One text per request that the tokenizer turns into exactly ``prompt_tokens`` tokens
    (special tokens included, as the router counts ``input_length``).

    Words are whole-word vocabulary entries (a leading-space marker and 3-8 lowercase letters), so
    the concatenation re-tokenizes word by word.
    """
    rng = np.random.default_rng(seed + 17)
    vocab = tokenizer.get_vocab()
    words = sorted(
        {
            tokenizer.convert_tokens_to_string([t]).strip()
            for t in vocab
            if len(t) >= 4
            and (t[0] in "\u0120\u2581")
            and t[1:].isascii()
            and t[1:].isalpha()
            and t[1:].islower()
            and len(t) <= 9
        }
    )
    words = [w for w in words if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1][:4000]
    if len(words) < 50:  # small test tokenizers: any alphabetic piece will do (lengths are then approximate)
        words = sorted(
            {w for w in (tokenizer.convert_tokens_to_string([t]).strip() for t in vocab) if w.isascii() and w.isalpha()}
        ) or ["a"]

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=True))

    prompts = []
    for req in trace:
        chosen = [words[i] for i in rng.integers(0, len(words), req.prompt_tokens)]
        while len(chosen) > 1 and count(" ".join(chosen)) > req.prompt_tokens:
            chosen.pop()
        for _ in range(4 * req.prompt_tokens):  # re-tokenization may merge words: top up
            if count(" ".join(chosen)) >= req.prompt_tokens:
                break
            chosen.append(words[int(rng.integers(0, len(words)))])
        while len(chosen) > 1 and count(" ".join(chosen)) > req.prompt_tokens:
            chosen.pop()
        prompts.append(" ".join(chosen))
    return prompts
