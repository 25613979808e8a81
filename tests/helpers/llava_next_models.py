"""A tiny random LLaVA-NeXT checkpoint (CLIP tower, Llama language model) written with transformers' own
classes, plus the test images and HF ``generate`` references with ``pixel_values`` (issue 40)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image

from tests.helpers.tiny_models import BOS_ID, EOS_ID, PAD_ID, make_tiny_tokenizer

IMAGE_TOKEN = "<image>"
PINPOINTS = [[32, 64], [64, 32], [64, 64]]
"""Anyres grids of 1x2, 2x1 and 2x2 tiles of 32 pixels: images become 24 to 84 placeholders."""


def write_llava_next_model(path: Path | str, *, seed: int = 0, crop: int = 32, strategy: str = "default") -> Path:
    """Write the tiny model, the tiny tokenizer with ``<image>`` added and the image processor to ``path``.

    ``crop`` (the processor's crop size) and ``strategy`` (``vision_feature_select_strategy``) other than
    the defaults make the checkpoints the loader refuses."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens([transformers.AddedToken(IMAGE_TOKEN, special=True)])
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    text = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, tie_word_embeddings=False,
    )  # fmt: skip
    config = transformers.LlavaNextConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=image_token_id,
        image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1, vision_feature_select_strategy=strategy,
    )  # fmt: skip
    config.vision_config.model_type = "clip_vision_model"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlavaNextForConditionalGeneration(config)
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
    transformers.LlavaNextImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": crop, "width": crop}, image_grid_pinpoints=PINPOINTS
    ).save_pretrained(path)
    return path


def png_bytes(height: int, width: int, seed: int) -> bytes:
    """A random ``height`` x ``width`` RGB image as PNG bytes."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class LlavaNextReference:
    """HF ``generate`` (float32, eager attention) on the checkpoint in ``path``, with ``pixel_values``."""

    def __init__(self, path: Path | str) -> None:
        self.model = (
            transformers.LlavaNextForConditionalGeneration.from_pretrained(
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
                kwargs.update(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"])
            with torch.no_grad():
                out = self.model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            self._cache[key] = out[0, x.shape[1] :].tolist()
        return self._cache[key]
