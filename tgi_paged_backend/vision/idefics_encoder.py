"""Idefics3 (and SmolVLM) and Idefics2: the placeholder text per image and the image embeddings (issue 40).

Idefics3 splits an image into a grid of tiles (the checkpoint's image processor decides the rows and
columns) plus a global view, and each tile becomes ``S`` embeddings (vision tower, pixel shuffle,
projection: ``S = (image_size / patch_size)² / scale_factor²``). The prompt text per image is the
processor's: per tile ``<fake_token_around_image><row_r_col_c>`` + ``<image>`` × S, ``\\n`` after each
row, then ``\\n<fake_token_around_image><global-img>`` + ``<image>`` × S + ``<fake_token_around_image>``
(an image that is not split is the global part alone, without the leading ``\\n``).

Idefics2 gives each image (or each of the 5 crops with ``do_image_splitting``) the perceiver's
``resampler_n_latents`` embeddings, wrapped ``<fake_token_around_image>`` ... ``<fake_token_around_image>``;
two touching separators collapse into one (stock's server does the same).

Either way the encoder runs the model's own ``get_image_features`` one image at a time and checks that
the embeddings count equals the placeholders the text got.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from PIL import Image as PILImage

FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TAG = "<global-img>"


class _IdeficsEncoder:
    """What Idefics2 and Idefics3 share: the per-image encode and its count check."""

    def __init__(self, model: Any, image_processor: Any) -> None:
        self.model = model
        self.image_processor = image_processor
        self.config = model.config
        self.image_token_id = int(model.config.image_token_id)

    def token_count(self, image: PILImage.Image) -> int:
        raise NotImplementedError

    def largest_image(self) -> PILImage.Image:
        """An image the processor splits into the most tiles (its longest-edge resize bound, square)."""
        from PIL import Image

        side = int(self.image_processor.size["longest_edge"])
        return Image.new("RGB", (side, side), (127, 127, 127))

    @staticmethod
    def finish_prompt(text: str) -> str:
        """The prompt with every placeholder in place: touching separators collapse into one."""
        return text.replace(FAKE_TOKEN + FAKE_TOKEN, FAKE_TOKEN)

    def encode(self, images: Sequence[PILImage.Image]) -> list[torch.Tensor]:
        """One ``[token_count(image), hidden]`` tensor per image, in the model's dtype and device."""
        device = next(self.model.parameters()).device
        features: list[torch.Tensor] = []
        for image in images:
            inputs = self.image_processor([[image]], return_tensors="pt")
            mask = inputs.get("pixel_attention_mask")
            with torch.inference_mode():
                out = self.model.get_image_features(
                    inputs["pixel_values"].to(device=device, dtype=self.model.dtype),
                    None if mask is None else mask.to(device),
                    return_dict=True,
                )
            pooled = out.pooler_output
            feature = torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled
            feature = feature.reshape(-1, feature.shape[-1])
            expected = self.token_count(image)
            if feature.shape[0] != expected:
                raise RuntimeError(
                    f"{self.config.model_type} produced {feature.shape[0]} embeddings for a "
                    f"{image.size[1]}x{image.size[0]} image, the placeholder rule gives {expected}"
                )
            features.append(feature)
        return features


class Idefics3Encoder(_IdeficsEncoder):
    """Idefics3 / SmolVLM: image tiles from the processor, ``S`` embeddings per tile."""

    def __init__(self, model: Any, image_processor: Any) -> None:
        super().__init__(model, image_processor)
        vision = model.config.vision_config
        self.tile_tokens = (int(vision.image_size) // int(vision.patch_size)) ** 2 // int(
            model.config.scale_factor
        ) ** 2
        """``S``: embeddings (and ``<image>`` placeholders) per tile."""

    def grid(self, image: PILImage.Image) -> tuple[int, int]:
        """``(rows, cols)`` of the tiles the processor splits the image into (``(0, 0)``: not split)."""
        width, height = image.size
        _, rows, cols = self.image_processor.get_number_of_image_patches(height, width, {})
        return int(rows), int(cols)

    def token_count(self, image: PILImage.Image) -> int:
        """``<image>`` placeholders (= embeddings) of the image: ``S`` per tile and for the global view."""
        rows, cols = self.grid(image)
        return self.tile_tokens * (rows * cols + 1)

    def placeholder_text(self, image: PILImage.Image, image_token: str) -> str:
        """The processor's text for the image (module docstring)."""
        rows, cols = self.grid(image)
        run = image_token * self.tile_tokens
        tiles = "".join(
            "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n" for r in range(rows)
        )
        return tiles + ("\n" if rows or cols else "") + f"{FAKE_TOKEN}{GLOBAL_TAG}{run}{FAKE_TOKEN}"

    @staticmethod
    def finish_prompt(text: str) -> str:
        """Nothing to collapse for Idefics3 (each image ends with its own separator, as the processor's)."""
        return text


class Idefics2Encoder(_IdeficsEncoder):
    """Idefics2: the perceiver's latents per image, 5 crops with ``do_image_splitting``."""

    def __init__(self, model: Any, image_processor: Any) -> None:
        super().__init__(model, image_processor)
        self.crop_tokens = int(model.config.perceiver_config.resampler_n_latents)
        self.crops = 5 if getattr(image_processor, "do_image_splitting", False) else 1

    def token_count(self, image: PILImage.Image) -> int:
        """``<image>`` placeholders of any image: the latents per crop, times the crops."""
        return self.crop_tokens * self.crops

    def placeholder_text(self, image: PILImage.Image, image_token: str) -> str:
        """``<fake>`` + ``<image>`` × latents + ``<fake>`` per crop (touching ``<fake>`` collapsed later)."""
        return f"{FAKE_TOKEN}{image_token * self.crop_tokens}{FAKE_TOKEN}" * self.crops
