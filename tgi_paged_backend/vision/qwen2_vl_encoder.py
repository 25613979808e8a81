"""Qwen2-VL / Qwen2.5-VL's VLM adapter: placeholders, image embeddings and M-RoPE positions per image.

Placeholders (stock's ``vlm_causal_lm.py``): ``<|vision_start|>`` + ``<|image_pad|>`` x ``t*h*w / merge**2``
+ ``<|vision_end|>``, where ``(t, h, w)`` is the image's patch grid after the checkpoint's own image
processor resizes it (``smart_resize``: both sides multiples of ``patch * merge``, the area kept within the
processor's ``[shortest_edge, longest_edge]`` pixels). The count is ours; stock's router counts
``h*w / patch**2`` on the original size as a budget only (docs/vlm.md).

:meth:`Qwen2VlEncoder.encode` runs the processor and the model's ``visual`` tower (its patch merger gives
one embedding per placeholder) and checks the grid against the count rule;
:meth:`Qwen2VlEncoder.rope_positions` gives the request's 3-D rotary positions
(:mod:`tgi_paged_backend.vision.mrope`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tgi_paged_backend.engine.types import InvalidRequestError
from tgi_paged_backend.vision.mrope import MRopePositions, mrope_positions

if TYPE_CHECKING:
    from PIL import Image as PILImage

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
"""The text around each image's placeholders (stock's server writes these literally)."""


def _pixel_bounds(image_processor: Any) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` of the processor (``size`` or the older ``min_pixels``/``max_pixels``)."""
    size = image_processor.size
    low = getattr(size, "shortest_edge", None) or getattr(image_processor, "min_pixels", None)
    high = getattr(size, "longest_edge", None) or getattr(image_processor, "max_pixels", None)
    if isinstance(size, dict):
        low, high = size.get("shortest_edge", low), size.get("longest_edge", high)
    if low is None or high is None:
        raise ValueError(f"the Qwen2-VL image processor's size {size!r} has no pixel bounds")
    return int(low), int(high)


class Qwen2VlEncoder:
    """Images -> per-image embeddings (``[t*h*w / merge**2, hidden]``), placeholders and M-RoPE positions."""

    def __init__(self, model: Any, image_processor: Any) -> None:
        self.model = model
        self.image_processor = image_processor
        self.config = model.config
        self.image_token_id = int(model.config.image_token_id)
        self.patch_size = int(image_processor.patch_size)
        self.merge_size = int(image_processor.merge_size)
        self.min_pixels, self.max_pixels = _pixel_bounds(image_processor)

    def grid(self, image: PILImage.Image) -> tuple[int, int, int]:
        """The image's ``(t, h, w)`` patch grid after the processor's resize (``InvalidRequestError`` for
        an aspect ratio the processor refuses)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        width, height = image.size
        try:
            resized_h, resized_w = smart_resize(
                height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels
            )
        except ValueError as err:
            raise InvalidRequestError(f"a {height}x{width} image cannot be resized for Qwen2-VL: {err}") from err
        return 1, resized_h // self.patch_size, resized_w // self.patch_size

    def token_count(self, image: PILImage.Image) -> int:
        """``<|image_pad|>`` placeholders the image needs."""
        grid_t, grid_h, grid_w = self.grid(image)
        return grid_t * grid_h * grid_w // self.merge_size**2

    def placeholder_text(self, image: PILImage.Image, image_token: str) -> str:
        """The prompt text at the image: the pads between the vision start and end tokens."""
        return VISION_START + image_token * self.token_count(image) + VISION_END

    @staticmethod
    def finish_prompt(text: str) -> str:
        """The prompt with every placeholder in place (nothing more for Qwen2-VL)."""
        return text

    def rope_positions(
        self, num_tokens: int, spans: Sequence[range], images: Sequence[PILImage.Image]
    ) -> MRopePositions:
        """The 3-D rotary positions of a ``num_tokens`` prompt with ``images`` at ``spans``."""
        return mrope_positions(num_tokens, spans, [self.grid(image) for image in images], self.merge_size)

    def largest_image(self) -> PILImage.Image:
        """An image the processor keeps as it is with the most merged patches ``max_pixels`` allows (the most
        placeholders one image gets), the squarest such grid."""
        from PIL import Image

        factor = self.patch_size * self.merge_size
        limit = max(1, self.max_pixels // factor**2)
        rows, cols = max(((r, limit // r) for r in range(1, math.isqrt(limit) + 1)), key=lambda rc: (rc[0] * rc[1], rc))
        return Image.new("RGB", (cols * factor, rows * factor), (127, 127, 127))

    def encode(self, images: Sequence[PILImage.Image]) -> list[torch.Tensor]:
        """One ``[token_count(image), hidden]`` tensor per image, in the model's dtype and device."""
        if not images:
            return []
        inputs = self.image_processor(list(images), return_tensors="pt")
        device = next(self.model.parameters()).device
        grids = inputs["image_grid_thw"]
        with torch.inference_mode():
            out = self.model.get_image_features(
                inputs["pixel_values"].to(device=device, dtype=self.model.dtype), grids.to(device), return_dict=True
            )
        features = list(out.pooler_output)
        for image, grid, feature in zip(images, grids.tolist(), features):
            if tuple(grid) != self.grid(image) or feature.shape[0] != self.token_count(image):
                raise RuntimeError(
                    f"Qwen2-VL's processor gave grid {grid} and {feature.shape[0]} embeddings for a "
                    f"{image.size[1]}x{image.size[0]} image; the placeholder rule gives {self.grid(image)}"
                )
        return features
