"""LLaVA-NeXT's image embeddings at prefill, and their merge into a prefill chunk's token embeddings.

:class:`LlavaNextEncoder` runs the checkpoint's own image processor on the decoded images, then the
model's vision tower + projector + anyres packing (``get_image_features``), giving one
``[count, hidden]`` tensor per image whose ``count`` is checked against the placeholder rule
(:func:`~tgi_paged_backend.vision.llava_next_tokens.image_token_count`), so a prompt built with that
rule always has a slot for every embedding.

:func:`merge_chunk_embeddings` places the embeddings of a prefill *chunk* ``[start, start + T)``:
chunked prefill may cut inside an image, so each image contributes the slice of its embeddings
that falls into the chunk. The embeddings are computed once per request and sliced per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tgi_paged_backend.vision.llava_next_tokens import LlavaNextGeometry, image_token_count

if TYPE_CHECKING:
    from PIL import Image as PILImage


class LlavaNextEncoder:
    """Images -> per-image embeddings in the language model's hidden size, with the model's own code."""

    def __init__(self, model: Any, image_processor: Any) -> None:
        self.model = model
        self.image_processor = image_processor
        self.config = model.config
        self.geometry = LlavaNextGeometry.from_config(model.config)
        self.image_token_id = int(model.config.image_token_index)

    def token_count(self, image: PILImage.Image) -> int:
        """Placeholders the image needs (PIL's size is (width, height))."""
        width, height = image.size
        return image_token_count(height, width, self.geometry)

    def placeholder_text(self, image: PILImage.Image, image_token: str) -> str:
        """The prompt text at the image: ``image_token`` once per embedding."""
        return image_token * self.token_count(image)

    @staticmethod
    def finish_prompt(text: str) -> str:
        """The prompt with every placeholder in place (nothing more for LLaVA-NeXT)."""
        return text

    def largest_image(self) -> PILImage.Image:
        """An image of the largest-area grid resolution (the most placeholders one image gets)."""
        from PIL import Image

        height, width = max(self.geometry.grid_pinpoints, key=lambda hw: (hw[0] * hw[1], hw))
        return Image.new("RGB", (width, height), (127, 127, 127))

    def encode(self, images: Sequence[PILImage.Image]) -> list[torch.Tensor]:
        """One ``[token_count(image), hidden]`` tensor per image, in the model's dtype and device."""
        if not images:
            return []
        inputs = self.image_processor(list(images), return_tensors="pt")
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            out = self.model.get_image_features(
                inputs["pixel_values"].to(device=device, dtype=self.model.dtype),
                inputs["image_sizes"].to(device),
                vision_feature_layer=self.config.vision_feature_layer,
                vision_feature_select_strategy=self.config.vision_feature_select_strategy,
                return_dict=True,
            )
        features = list(out.pooler_output)
        for image, feature in zip(images, features):
            expected = self.token_count(image)
            if feature.shape[0] != expected:
                raise RuntimeError(
                    f"LLaVA-NeXT produced {feature.shape[0]} embeddings for a {image.size[1]}x{image.size[0]} "
                    f"image, the placeholder rule gives {expected}"
                )
        return features


def merge_chunk_embeddings(
    token_embeds: torch.Tensor, chunk_start: int, spans: Sequence[range], features: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``token_embeds`` (``[T, hidden]``, prompt positions ``chunk_start..chunk_start+T``) with every
    position inside an image span replaced by that image's embedding for the position."""
    chunk_end = chunk_start + token_embeds.shape[0]
    merged = token_embeds
    for span, feature in zip(spans, features):
        lo, hi = max(span.start, chunk_start), min(span.stop, chunk_end)
        if lo >= hi:
            continue
        if merged is token_embeds:
            merged = token_embeds.clone()
        merged[lo - chunk_start : hi - chunk_start] = feature[lo - span.start : hi - span.start].to(merged.dtype)
    return merged
