"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints (vision tower of depth 2, 4 px patches, 2x2 merge, Qwen2
language model with 3-D M-RoPE) written with transformers' own classes, plus HF ``generate`` references with
``pixel_values`` and ``image_grid_thw`` (issue 40)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image

from tests.helpers.tiny_models import BOS_ID, EOS_ID, PAD_ID, make_tiny_tokenizer

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
PATCH, MERGE = 4, 2
"""A 4 px patch, 2x2 merge: one placeholder per 8x8 pixels of the resized image."""


def _text_config(model_type: str) -> dict[str, Any]:
    return dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, tie_word_embeddings=False, rope_parameters={"rope_type": "default",
        "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )  # fmt: skip


def _vision_config(model_type: str) -> dict[str, Any]:
    if model_type == "qwen2_vl":
        return dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE,
                    temporal_patch_size=2, mlp_ratio=2)  # fmt: skip
    return dict(depth=2, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=2, patch_size=PATCH,
                spatial_merge_size=MERGE, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])  # fmt: skip


def write_qwen2_vl_model(path: Path | str, model_type: str = "qwen2_vl", *, seed: int = 0) -> Path:
    """Write the tiny ``model_type`` (``qwen2_vl`` or ``qwen2_5_vl``) model, the tiny tokenizer with the
    vision tokens added, and the image processor (min 8x8, max 64x64 pixels after ``smart_resize``) to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens([transformers.AddedToken(t, special=True) for t in (VISION_START, IMAGE_PAD, VISION_END)])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END)}
    classes = {
        "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    }
    config_class, model_class = classes[model_type]
    config = config_class(
        text_config=_text_config(model_type), vision_config=_vision_config(model_type),
        image_token_id=ids[IMAGE_PAD], video_token_id=PAD_ID, vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END], tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # std 0.2 (init's 0.02 gives near-constant tokens), norms around 1
            for name, param in sorted(model.named_parameters()):
                if "norm" in name and name.endswith("weight"):
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
                else:
                    param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.Qwen2VLImageProcessor(
        size={"shortest_edge": 8 * 8, "longest_edge": 64 * 64}, patch_size=PATCH, merge_size=MERGE,
        temporal_patch_size=2,
    ).save_pretrained(path)  # fmt: skip
    return path


def png_bytes(height: int, width: int, seed: int) -> bytes:
    """A random ``height`` x ``width`` RGB image as PNG bytes."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class Qwen2VlReference:
    """HF ``generate`` (float32, eager attention) on the checkpoint in ``path``, with ``pixel_values`` and
    ``image_grid_thw`` (the model computes its own M-RoPE positions and ``rope_deltas``)."""

    def __init__(self, path: Path | str) -> None:
        self.model = (
            transformers.AutoModelForImageTextToText.from_pretrained(
                path, attn_implementation="eager", local_files_only=True
            )
            .float()
            .eval()
        )
        self.processor = transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True)
        self._cache: dict[tuple[Any, ...], list[int]] = {}

    def greedy(self, prompt_ids: list[int], images: list[bytes], n: int) -> list[int]:
        """``n`` greedy tokens after ``prompt_ids`` (placeholders included) with ``images`` in order."""
        key = (tuple(prompt_ids), tuple(images), n)
        if key not in self._cache:
            x = torch.tensor([prompt_ids])
            kwargs: dict[str, Any] = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False)
            if images:
                pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
                inputs = self.processor(pil, return_tensors="pt")
                image_token = self.model.config.image_token_id
                kwargs.update(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                              mm_token_type_ids=(x == image_token).int())  # fmt: skip
            with torch.no_grad():
                out = self.model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            self._cache[key] = out[0, x.shape[1] :].tolist()
        return self._cache[key]
