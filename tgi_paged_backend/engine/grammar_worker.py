"""What a grammar-compile process runs: build one ``outlines_core.Index``.

outlines-core holds the GIL while it builds an automaton (seconds for a large JSON schema over a 50k
vocabulary), so a compile on a thread would stall the step loop; it runs in a separate process
instead. This module imports nothing heavy, so that process starts fast and small.
"""

from __future__ import annotations

import outlines_core


def compile_index(vocabulary: outlines_core.Vocabulary, regex: str) -> outlines_core.Index:
    """The index of ``regex`` over ``vocabulary`` (both cross the process boundary pickled)."""
    return outlines_core.Index(regex, vocabulary)
