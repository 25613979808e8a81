"""LLaVA-NeXT's image-token count per image: how many ``<image>`` placeholders one image becomes.

The model's vision path (anyres: a base tile of the whole image plus the tiles of the best grid
resolution, unpadded back to the image's aspect ratio, one newline embedding per row) produces
exactly this many embeddings, so the prompt must hold exactly this many placeholders. The rule is
the one of transformers' LLaVA-NeXT processor; stock TGI's router (``config.rs``) and server
(``vlm_causal_lm.py``) use the same rule (integer arithmetic, equal on the sizes tested), so the
router's ``input_length`` is exact for this family. Written from the rule, not copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LlavaNextGeometry:
    """What the count depends on: the vision tower's tile and patch sizes and the processor's grids."""

    image_size: int
    """``vision_config.image_size``: the side of one tile (the processor's crop size)."""
    patch_size: int
    """``vision_config.patch_size``."""
    grid_pinpoints: tuple[tuple[int, int], ...]
    """``image_grid_pinpoints``: the candidate (height, width) resolutions of the anyres grid."""

    @classmethod
    def from_config(cls, config: Any) -> LlavaNextGeometry:
        vision = config.vision_config
        pinpoints = tuple((int(h), int(w)) for h, w in config.image_grid_pinpoints)
        return cls(image_size=int(vision.image_size), patch_size=int(vision.patch_size), grid_pinpoints=pinpoints)


def best_resolution(height: int, width: int, candidates: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The candidate (h, w) that keeps the most of the image's pixels when it is fitted inside,
    ties broken by the least wasted area (the anyres rule)."""
    best: tuple[int, int] | None = None
    best_effective, best_wasted = -1, 0
    for cand_h, cand_w in candidates:
        scale = min(cand_w / width, cand_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = cand_h * cand_w - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (cand_h, cand_w), effective, wasted
    if best is None:
        raise ValueError("image_grid_pinpoints is empty")
    return best


def _unpadded_rows_cols(height: int, width: int, rows: int, cols: int) -> tuple[int, int]:
    """The patch rows and columns of a ``rows`` x ``cols`` canvas left after removing the padding that
    fitting a ``height`` x ``width`` image into it added (symmetric, on the longer side)."""
    if width / height > cols / rows:
        fitted = int(round(height * (cols / width), 7))
        return rows - 2 * ((rows - fitted) // 2), cols
    fitted = int(round(width * (rows / height), 7))
    return rows, cols - 2 * ((cols - fitted) // 2)


def image_token_count(height: int, width: int, geometry: LlavaNextGeometry) -> int:
    """``<image>`` placeholders for one ``height`` x ``width`` image (original pixel size)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {height}x{width}")
    side = geometry.image_size // geometry.patch_size
    grid_h, grid_w = best_resolution(height, width, geometry.grid_pinpoints)
    rows, cols = _unpadded_rows_cols(
        height, width, side * (grid_h // geometry.image_size), side * (grid_w // geometry.image_size)
    )
    return rows * cols + rows + side * side
