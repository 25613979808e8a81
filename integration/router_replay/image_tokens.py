"""Stock's router rules for the text an image counts as in ``input_length`` (``router/src/validation.rs``
``image_tokens`` and ``image_tokens_fixup``, ``config.rs``), for the VLM families this backend serves.

- LLaVA-NeXT: ``<image>`` × the anyres count (the product's own rule, equal to stock's).
- Idefics3 (``model_type`` ``idefics3``; SmolVLM v1 checkpoints use it): stock hardcodes SmolVLM's defaults,
  whatever the checkpoint: the image scaled so its longest edge is 1456 (then down to at most 4096), in f32,
  truncated; split into ``ceil(edge / 364)`` rows and columns when an edge exceeds 364 (always, after that
  resize); 169 ``<image>`` per tile. A *budget*: the shard counts its own (``vision/idefics_encoder.py``).
- Qwen2-VL, Qwen2.5-VL: ``height * width // patch**2`` pads, Debug-quoted (a budget, see below).
- Idefics2: ``<fake_token_around_image>`` + ``<image>`` × 64 + ``<fake_token_around_image>``, five times when
  the checkpoint's ``preprocessor_config.json`` says ``"processor_class": "Idefics2Processor"`` and
  ``do_image_splitting``; then every ``<fake><fake>`` in the whole text collapsed into one.
- Gemma 3: ``\n\n<start_of_image>`` + ``<image_soft_token>`` × 256 (hardcoded, whatever the config's
  ``mm_tokens_per_image``: a budget, exact for every released checkpoint) + ``<end_of_image>\n\n``.
- PaliGemma: ``<image>`` × ``text_config.num_image_tokens``; the router counts the text as sent (the shard's
  ``<bos>`` + text + ``\n`` wrap is server-side, and it tokenizes without special tokens: the shard's prompt is one
  token longer than the router's count for one text chunk, which the ``max_new_tokens - 1`` slots absorb).

The ``model_type`` ``smolvlm`` (SmolVLM2) is not in stock's router ``Config``: there the images stay text.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

FAKE = "<fake_token_around_image>"
IMAGE = "<image>"
GLOBAL_IMG = "<global-img>"

IDEFICS3_RESIZE_EDGE = 1456
IDEFICS3_MAX_IMAGE_SIZE = 4096
IDEFICS3_TILE_EDGE = 364
IDEFICS3_TILE_TOKENS = 169
IDEFICS2_IMAGE_TOKENS = 64
GEMMA3_IMAGE_TOKENS = 256


@dataclass(frozen=True)
class RouterImageRule:
    """``rule(height, width)``: one image's placeholder text; ``fixup(text)``: the whole counted text after."""

    text: Callable[[int, int], str]
    collapse_fake_pairs: bool = False

    def __call__(self, height: int, width: int) -> str:
        return self.text(height, width)

    def fixup(self, text: str) -> str:
        """Stock's ``image_tokens_fixup`` (Idefics2 only: touching separators collapsed)."""
        return text.replace(FAKE + FAKE, FAKE) if self.collapse_fake_pairs else text


def idefics3_grid(height: int, width: int) -> tuple[int, int]:
    """Stock's Idefics3 ``(rows, cols)`` (``(0, 0)``: not split), in f32 as the router computes it."""
    h, w = np.float32(height), np.float32(width)
    scale = np.float32(IDEFICS3_RESIZE_EDGE) / max(h, w)
    h, w = h * scale, w * scale
    shrink = min(np.float32(IDEFICS3_MAX_IMAGE_SIZE) / max(h, w), np.float32(1.0))
    rows_px, cols_px = int(h * shrink), int(w * shrink)
    if rows_px <= IDEFICS3_TILE_EDGE and cols_px <= IDEFICS3_TILE_EDGE:
        return 0, 0
    edge = np.float32(IDEFICS3_TILE_EDGE)
    return math.ceil(np.float32(rows_px) / edge), math.ceil(np.float32(cols_px) / edge)


def idefics3_text(height: int, width: int) -> str:
    """Stock's Idefics3 placeholder text for one image."""
    rows, cols = idefics3_grid(height, width)
    run = IMAGE * IDEFICS3_TILE_TOKENS
    tiles = "".join("".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n" for r in range(rows))
    return tiles + ("\n" if rows or cols else "") + f"{FAKE}{GLOBAL_IMG}{run}{FAKE}"


def idefics2_rule(preprocessor: dict[str, Any] | None) -> RouterImageRule:
    """Stock's Idefics2 rule with the checkpoint's ``preprocessor_config.json`` (``None``: none)."""
    splitting = bool(
        preprocessor
        and preprocessor.get("processor_class") == "Idefics2Processor"
        and preprocessor.get("do_image_splitting", False)
    )
    one = f"{FAKE}{IMAGE * IDEFICS2_IMAGE_TOKENS}{FAKE}"
    return RouterImageRule(lambda height, width: one * (5 if splitting else 1), collapse_fake_pairs=True)


def router_image_rule(config: Any, preprocessor: dict[str, Any] | None = None) -> RouterImageRule | None:
    """Stock's rule for ``config`` (a ``transformers`` config) if this replay knows it, else ``None``."""
    model_type = getattr(config, "model_type", None)
    if model_type == "llava_next":
        from tgi_paged_backend.vision.llava_next_tokens import LlavaNextGeometry, image_token_count

        geometry = LlavaNextGeometry.from_config(config)
        return RouterImageRule(lambda height, width: IMAGE * image_token_count(height, width, geometry))
    if model_type == "idefics3":
        return RouterImageRule(idefics3_text)
    if model_type == "idefics2":
        return idefics2_rule(preprocessor)
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        return RouterImageRule(qwen2_vl_budget_text(config))
    if model_type == "gemma3":
        text = f"\n\n<start_of_image>{'<image_soft_token>' * GEMMA3_IMAGE_TOKENS}<end_of_image>\n\n"
        return RouterImageRule(lambda height, width: text)
    if model_type == "paligemma":
        count = int(config.text_config.num_image_tokens)
        return RouterImageRule(lambda height, width: IMAGE * count)
    return None


def qwen2_vl_budget_text(config: Any) -> Callable[[int, int], str]:
    """Stock's ``config.rs`` for Qwen2-VL / Qwen2.5-VL: ``height * width // patch**2`` pads on the original
    size (no resize, no merge; Qwen2.5-VL reads ``spatial_patch_size``, which released configs carry, else
    ``patch_size`` here), Debug-formatted (``{:?}``: the quotes are part of the text). A budget: the shard
    counts its own placeholders (``vision.qwen2_vl_encoder``), fewer for any image larger than one merged patch."""
    vision = config.vision_config
    patch = getattr(vision, "spatial_patch_size", None) if config.model_type == "qwen2_5_vl" else None
    patch = int(patch or vision.patch_size)
    return lambda height, width: f'<|vision_start|>"{"<|image_pad|>" * (height * width // patch**2)}"<|vision_end|>'
