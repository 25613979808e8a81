"""Gemma 3 (vision) and PaliGemma: the placeholder text per image, the bidirectional spans, the embeddings.

Both run a SigLIP tower and a projector once per image over the checkpoint's image processor (a fixed-size
resize, so every image gets the same count), through the model's own ``get_image_features``.

- **Gemma 3**: each image becomes ``\\n\\n<start_of_image>`` + ``<image_soft_token>`` × ``mm_tokens_per_image`` +
  ``<end_of_image>\\n\\n`` (stock's ``vlm_causal_lm.py``; stock counts 256, every released checkpoint's
  ``mm_tokens_per_image``: the shard counts the config's, the router's budget stays stock's 256). The soft
  tokens of one image attend to each other both ways (``token_type_ids`` 1 in transformers: one span per run
  of image tokens), text is causal.
- **PaliGemma**: each image is ``<image>`` × ``text_config.num_image_tokens``, each text chunk is wrapped
  ``<bos>`` + text + ``\\n`` and nothing else is added (stock: ``preprocess_text``, ``add_special_tokens`` off),
  so a prompt ``[image, "caption en"]`` is the processor's ``<image>…<bos>caption en\\n``. The whole prompt is a
  prefix-LM prefix (``token_type_ids`` 0 over it in transformers): one span over every prompt token, a
  text-only prompt's too; generated tokens are causal. Its rotary positions start at 1 (:attr:`position_offset`).

Stock's own server differs in two places, where transformers (and so these adapters) are followed: stock's
PaliGemma attends causally over the prompt, and stock's Gemma 3 lets the tokens of *all* images of a request
attend to each other (one mask over every image token), not image by image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from PIL import Image as PILImage

GEMMA3_BOI = "<start_of_image>"
GEMMA3_EOI = "<end_of_image>"
PALIGEMMA_BOS = "<bos>"


class _SiglipEncoder:
    """What both share: one fixed-size image per tower call, the embeddings' count checked."""

    def __init__(self, model: Any, image_processor: Any) -> None:
        self.model = model
        self.image_processor = image_processor
        self.config = model.config
        self.image_token_id = int(model.config.image_token_id)

    def token_count(self, image: PILImage.Image) -> int:
        raise NotImplementedError

    def largest_image(self) -> PILImage.Image:
        """Every image is resized to the processor's size: any one has the most placeholders."""
        from PIL import Image

        size = self.image_processor.size
        return Image.new("RGB", (int(size["width"]), int(size["height"])), (127, 127, 127))

    @staticmethod
    def finish_prompt(text: str) -> str:
        return text

    def encode(self, images: Sequence[PILImage.Image]) -> list[torch.Tensor]:
        """One ``[token_count(image), hidden]`` tensor per image, in the model's dtype and device."""
        device = next(self.model.parameters()).device
        features: list[torch.Tensor] = []
        for image in images:
            pixels = self.image_processor([image.convert("RGB")], return_tensors="pt")["pixel_values"]
            with torch.inference_mode():
                out = self.model.get_image_features(pixels.to(device=device, dtype=self.model.dtype), return_dict=True)
            feature = out.pooler_output.reshape(-1, out.pooler_output.shape[-1])
            expected = self.token_count(image)
            if feature.shape[0] != expected:
                raise RuntimeError(
                    f"{self.config.model_type} produced {feature.shape[0]} embeddings for an image, the placeholder "
                    f"rule gives {expected}"
                )
            features.append(feature)
        return features


class Gemma3Encoder(_SiglipEncoder):
    """Gemma 3: ``mm_tokens_per_image`` soft tokens per image, each image's run bidirectional."""

    def token_count(self, image: PILImage.Image) -> int:
        return int(self.config.mm_tokens_per_image)

    def placeholder_text(self, image: PILImage.Image, image_token: str) -> str:
        return f"\n\n{GEMMA3_BOI}{image_token * self.token_count(image)}{GEMMA3_EOI}\n\n"

    @staticmethod
    def bidirectional_spans(num_tokens: int, image_spans: Sequence[range]) -> list[range]:
        """Each image's run of soft tokens (transformers' blocks of adjacent ``token_type_ids == 1``)."""
        return [span for span in image_spans if len(span)]


class PaliGemmaEncoder(_SiglipEncoder):
    """PaliGemma: ``num_image_tokens`` per image, the whole prompt one prefix-LM span, positions from 1."""

    adds_special_tokens = False
    """Stock tokenizes PaliGemma's prompt without special tokens: the wrap puts the ``<bos>`` itself."""
    router_slack = 2
    """Tokens per text chunk the router's ``input_length`` does not count: the wrap's ``<bos>`` and ``\n`` (one
    fewer with the router's own BOS): the shard's prompt may pass the reservation by that much."""
    position_offset = 1
    """Rotary positions are 1-indexed (transformers' ``PaliGemmaModel``, stock's ``position_ids += 1``)."""

    @property
    def span_window(self) -> int | None:
        """PaliGemma 2's sliding window (Gemma 2), else ``None``: transformers lets the prefix see past it on the
        sliding layers, so a prompt must fit it (``attend_spans.longest_span_reason``; 4096 in the released ones)."""
        window = getattr(self.config.text_config, "sliding_window", None)
        return int(window) if window else None

    def token_count(self, image: PILImage.Image) -> int:
        return int(self.config.text_config.num_image_tokens)

    def placeholder_text(self, image: PILImage.Image, image_token: str) -> str:
        return image_token * self.token_count(image)

    @staticmethod
    def wrap_text(text: str) -> str:
        """Each text chunk as stock's ``preprocess_text`` writes it."""
        return f"{PALIGEMMA_BOS}{text}\n"

    @staticmethod
    def bidirectional_spans(num_tokens: int, image_spans: Sequence[range]) -> list[range]:
        """The whole prompt: images, ``<bos>``, text and the closing ``\\n`` (the prefix)."""
        return [range(0, num_tokens)]
