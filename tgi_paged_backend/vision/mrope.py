"""Multimodal rotary positions (M-RoPE, Qwen2-VL / Qwen2.5-VL): a ``(t, h, w)`` position per token.

The language model rotates each query/key by three position streams (temporal, height, width; its
``mrope_section`` splits the rotary dimensions between them). A text token has the same position in all
three; an image's ``g_t x g_h x g_w`` merged patches (``g = grid / merge``, in row-major order) take
``start + t``, ``start + row``, ``start + column`` where ``start`` is the position after the text before
it, and the text after the image continues at ``start + max(g_h, g_w)`` (the image spans fewer positions
than it has tokens). Every position past the prompt (generated tokens, decode) is its index plus the
prompt's *delta*: ``max position + 1 - prompt length``, carried by the request for its whole life.

This is the rule of transformers' ``get_rope_index`` for images (``t`` is 0 for an image: its temporal
grid is 1), written from its description. The positions are a function of the prompt and its images'
grids, so they are computed once at admission; a retained-prefix hit or a recompute preemption slices the
same array again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class MRopePositions:
    """A request's M-RoPE positions: the prompt's ``[3, L]`` and the delta every later position gets."""

    prompt: np.ndarray
    """``[3, L]`` int64 ``(t, h, w)`` positions of the prompt tokens."""
    delta: int
    """Added to the index of every position past the prompt (``max(prompt) + 1 - L``, ``<= 0``)."""

    def at(self, positions: np.ndarray) -> np.ndarray:
        """``[3, n]`` positions of token indices ``positions`` (``[n]``; prompt or generated)."""
        positions = np.asarray(positions, dtype=np.int64)
        inside = positions < self.prompt.shape[1]
        out = np.broadcast_to(positions + self.delta, (3, positions.shape[0])).copy()
        out[:, inside] = self.prompt[:, positions[inside]]
        return out


def mrope_positions(num_tokens: int, spans: Sequence[range], grids: Sequence[tuple[int, int, int]],
                    merge: int) -> MRopePositions:  # fmt: skip
    """The positions of a ``num_tokens`` prompt whose image ``i`` sits at ``spans[i]`` with patch grid
    ``grids[i]`` (``(t, h, w)`` before the ``merge`` x ``merge`` spatial merge)."""
    prompt = np.empty((3, num_tokens), dtype=np.int64)
    index, position = 0, 0  # next token index, its position as text
    for span, (grid_t, grid_h, grid_w) in sorted(zip(spans, grids), key=lambda sg: sg[0].start):
        rows, cols = grid_h // merge, grid_w // merge
        if len(span) != grid_t * rows * cols:
            raise ValueError(f"an image span of {len(span)} tokens for a {grid_t}x{grid_h}x{grid_w} grid")
        text = span.start - index
        prompt[:, index : span.start] = np.arange(position, position + text)
        position += text
        t, h, w = np.meshgrid(np.arange(grid_t), np.arange(rows), np.arange(cols), indexing="ij")
        prompt[:, span.start : span.stop] = np.stack([t.ravel(), h.ravel(), w.ravel()]) + position
        position += max(rows, cols)
        index = span.stop
    prompt[:, index:] = np.arange(position, position + num_tokens - index)
    position += num_tokens - index
    return MRopePositions(prompt, position - num_tokens)
