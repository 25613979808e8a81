"""Loading the vision-language families the paged path serves (issue 40, docs/vlm.md).

Each served family has a *VLM adapter* (:data:`ENCODERS`): the class that holds its placeholder rule
(``placeholder_text``, ``token_count``), its image encoder (processor + tower + connector, ``encode``) and
the image Warmup sizes the tower's peak with (``largest_image``); the embedding merge is shared
(:mod:`tgi_paged_backend.runner.image_embeds`). :func:`checkpoint_reason` refuses what a family's rule
does not cover.

Such a checkpoint loads through ``AutoModelForImageTextToText`` with one attention implementation per
sub-config: the paged attention for the language model (``text_config``), SDPA for the vision tower
(its attention is bidirectional over one image and never touches the KV pool). The image side is
:class:`~tgi_paged_backend.vision.llava_next_encoder.LlavaNextEncoder` over the checkpoint's own image
processor. Only checkpoints the placeholder rule of
:mod:`~tgi_paged_backend.vision.llava_next_tokens` covers are served: the processor's crop size must be
the tower's ``image_size`` and ``vision_feature_select_strategy`` must be ``"default"`` (the released
checkpoints'); others are refused with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

ENCODERS: dict[str, str] = {
    "llava_next": "tgi_paged_backend.vision.llava_next_encoder:LlavaNextEncoder",
    "idefics3": "tgi_paged_backend.vision.idefics_encoder:Idefics3Encoder",
    "smolvlm": "tgi_paged_backend.vision.idefics_encoder:Idefics3Encoder",
    "idefics2": "tgi_paged_backend.vision.idefics_encoder:Idefics2Encoder",
    "qwen2_vl": "tgi_paged_backend.vision.qwen2_vl_encoder:Qwen2VlEncoder",
    "qwen2_5_vl": "tgi_paged_backend.vision.qwen2_vl_encoder:Qwen2VlEncoder",
    "gemma3": "tgi_paged_backend.vision.gemma_encoder:Gemma3Encoder",
    "paligemma": "tgi_paged_backend.vision.gemma_encoder:PaliGemmaEncoder",
}
"""Served ``model_type`` -> its VLM adapter class (``module:Class``, imported at load)."""
SERVED_VLM_MODEL_TYPES = frozenset(ENCODERS)
"""Vision-language ``model_type``s the paged path serves (the others stay refused: ``family_support``)."""

PREPROCESSOR_CONFIG = "preprocessor_config.json"


def is_served_vlm(config: Any) -> bool:
    """Whether ``config`` is a vision-language model the paged path serves."""
    return str(getattr(config, "model_type", "")) in SERVED_VLM_MODEL_TYPES


def attention_implementations(attn_name: str, config: Any) -> dict[str, str]:
    """``attn_implementation`` per sub-config: ours for the language model, SDPA for the others (vision
    tower, perceiver) and the top level."""
    subs = [name for name in getattr(config, "sub_configs", {}) if name != "text_config"]
    return {"text_config": attn_name, **{name: "sdpa" for name in subs}, "": "sdpa"}


def _crop_side(processor_config: dict[str, Any]) -> int | None:
    crop = processor_config.get("crop_size")
    if isinstance(crop, dict):
        height, width = crop.get("height"), crop.get("width")
        return int(height) if height == width and height is not None else None
    return None if crop is None else int(crop)


def checkpoint_reason(config: Any, path: Path) -> str | None:
    """Why the VLM checkpoint in ``path`` is outside what its family's placeholder rule covers, or ``None``."""
    if not (path / PREPROCESSOR_CONFIG).is_file():
        return f"the checkpoint has no {PREPROCESSOR_CONFIG}: the image processor the images need is missing"
    if str(config.model_type) == "llava_next":
        return _llava_next_reason(config, path)
    if str(config.model_type) in ("idefics3", "smolvlm"):
        return _idefics3_reason(config, path)
    if str(config.model_type) == "gemma3":
        return _gemma3_reason(path)
    return None


def _gemma3_reason(path: Path) -> str | None:
    """Pan-and-scan crops add an image sequence per crop, which neither stock's count nor the adapter writes."""
    if json.loads((path / PREPROCESSOR_CONFIG).read_text()).get("do_pan_and_scan"):
        return "the image processor has do_pan_and_scan on: its crops are not counted (stock counts 256 per image)"
    return None


def _idefics3_reason(config: Any, path: Path) -> str | None:
    """The processor's tile edge must be the tower's ``image_size`` (each tile gives S embeddings)."""
    tile = json.loads((path / PREPROCESSOR_CONFIG).read_text()).get("max_image_size", {}).get("longest_edge")
    image_size = int(config.vision_config.image_size)
    if tile is not None and int(tile) != image_size:
        return (
            f"the image processor's tile edge (max_image_size {tile}) differs from the vision tower's image_size "
            f"({image_size}): each tile must be one tower input"
        )
    return None


def _llava_next_reason(config: Any, path: Path) -> str | None:
    strategy = getattr(config, "vision_feature_select_strategy", None)
    if strategy != "default":
        return (
            f"vision_feature_select_strategy={strategy!r} is not served: the image-token count rule (and stock "
            "TGI's router) assumes 'default' (the CLS feature dropped)"
        )
    file = path / PREPROCESSOR_CONFIG
    image_size = int(config.vision_config.image_size)
    crop = _crop_side(json.loads(file.read_text()))
    if crop != image_size:
        return (
            f"the image processor's crop size ({crop}) differs from the vision tower's image_size ({image_size}): "
            "the image-token count rule (and stock TGI's router) assumes they are equal"
        )
    return None


def load_image_encoder(model: Any, path: Path) -> Any:
    """The encoder turning a request's images into embeddings, with the checkpoint's image processor."""
    import importlib

    import transformers

    module, name = ENCODERS[str(model.config.model_type)].split(":")
    processor = transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True)
    return getattr(importlib.import_module(module), name)(model, processor)


TEXT_MODELS = ("language_model", "text_model")
"""Where a vision-language model keeps its language model (``model.model.<name>`` in transformers 5, or
``model.<name>``): tensor parallelism slices only its decoder layers (the vision tower and Idefics2's resampler stay
whole on every rank, which encodes the images itself) and only its layers get native decode steps."""


def text_model(model: nn.Module) -> nn.Module:
    """The module holding the decoder layers: a VLM's language model, else ``model``."""
    for owner in (getattr(model, "model", None), model):
        for name in TEXT_MODELS:
            found = getattr(owner, name, None) if isinstance(owner, nn.Module) else None
            if isinstance(found, nn.Module):
                return found
    return model
