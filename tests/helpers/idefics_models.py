"""Tiny random Idefics3, SmolVLM and Idefics2 checkpoints written with transformers' own classes, and HF
``generate`` references with the processor's ``pixel_values`` (issue 40).

Idefics3 / SmolVLM: a 32 px tile of 8 px patches, pixel shuffle 2 -> S = 4 ``<image>`` per tile; the
processor resizes the longest edge to 64 and splits into 32 px tiles (grids up to 2x2 + the global view,
4 to 20 placeholders). Idefics2: a perceiver of 4 latents; with ``do_image_splitting`` 5 crops (20).
The language model is Llama (Idefics3, SmolVLM) or Mistral (Idefics2), as the released checkpoints'."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image

from tests.helpers.tiny_models import BOS_ID, EOS_ID, PAD_ID, make_tiny_tokenizer

IMAGE_TOKEN = "<image>"
EXTRA_TOKENS = ["<fake_token_around_image>", "<global-img>"] + [f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]

_TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    pad_token_id=PAD_ID, tie_word_embeddings=False,
)  # fmt: skip
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
               patch_size=8)  # fmt: skip


def _config(family: str, image_token_id: int, max_positions: int) -> Any:
    text = {**_TEXT, "max_position_embeddings": max_positions}
    if family == "idefics2":
        return transformers.Idefics2Config(
            vision_config=_VISION, text_config={**text, "model_type": "mistral"}, image_token_id=image_token_id,
            perceiver_config=dict(hidden_size=64, resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2,
                                  resampler_head_dim=16, num_key_value_heads=1),
        )  # fmt: skip
    cls = transformers.SmolVLMConfig if family == "smolvlm" else transformers.Idefics3Config
    return cls(vision_config=_VISION, text_config={**text, "model_type": "llama"}, image_token_id=image_token_id,
               scale_factor=2)  # fmt: skip


def _processor(family: str, splitting: bool) -> Any:
    if family == "idefics2":
        return transformers.Idefics2ImageProcessor(
            size={"shortest_edge": 32, "longest_edge": 64}, do_image_splitting=splitting
        )
    cls = transformers.SmolVLMImageProcessor if family == "smolvlm" else transformers.Idefics3ImageProcessor
    return cls(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=splitting)


def write_idefics_model(
    path: Path | str, family: str = "idefics3", *, seed: int = 0, splitting: bool = True, max_positions: int = 512
) -> Path:
    """Write the tiny ``family`` model (``idefics3``, ``smolvlm``, ``idefics2``), the tiny tokenizer with the
    image tokens added and the image processor to ``path`` (``max_positions``: the language model's
    ``max_position_embeddings``, larger for the router's Idefics3 budget)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens([transformers.AddedToken(t, special=True) for t in [IMAGE_TOKEN, *EXTRA_TOKENS]])
    config = _config(family, tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), max_positions)
    model_class = transformers.AutoModelForImageTextToText.from_config
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
    _processor(family, splitting).save_pretrained(path)
    return path


def png_bytes(height: int, width: int, seed: int) -> bytes:
    """A random ``height`` x ``width`` RGB image as PNG bytes."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class IdeficsReference:
    """HF ``generate`` (float32, eager attention) on the checkpoint in ``path``, with ``pixel_values``."""

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
                inputs = self.processor([pil], return_tensors="pt")
                kwargs.update(pixel_values=inputs["pixel_values"], pixel_attention_mask=inputs["pixel_attention_mask"])
            with torch.no_grad():
                out = self.model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            self._cache[key] = out[0, x.shape[1] :].tolist()
        return self._cache[key]
