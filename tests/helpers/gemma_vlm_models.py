"""Tiny random Gemma 3 (vision) and PaliGemma checkpoints written with transformers' own classes, and HF
``generate`` references with ``pixel_values`` and ``token_type_ids`` as their processors give them (issue 40).

Gemma 3: a SigLIP tower of 32 px images in 4 px patches (64 patches) pooled to ``mm_tokens_per_image`` 16 soft
tokens; a Gemma 3 language model with a sliding layer (window 8, shorter than an image: the window still counts
back from each token) and a full one. PaliGemma: a SigLIP tower of 32 px images in 8 px patches (16 ``<image>``),
a Gemma language model (``gemma``) or Gemma 2 (``gemma2``: PaliGemma 2, soft-capping and a window of 56, which
the longest test prompt fits: transformers lets the prefix see past the window, the shard refuses longer ones).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image

from tests.helpers.tiny_models import BOS_ID, EOS_ID, PAD_ID, make_tiny_tokenizer

GEMMA3_TOKENS = ("<image_soft_token>", "<start_of_image>", "<end_of_image>")
PALIGEMMA_TOKENS = ("<image>", "<bos>")

_TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)  # fmt: skip
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32)


def _config(family: str, ids: list[int], text_model: str, max_positions: int = 512) -> Any:
    if family == "gemma3":
        text = {**_TEXT, "max_position_embeddings": max_positions, "model_type": "gemma3_text", "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16}  # fmt: skip
        return transformers.Gemma3Config(
            text_config=text, vision_config={**_VISION, "patch_size": 4}, mm_tokens_per_image=16,
            image_token_index=ids[0], boi_token_index=ids[1], eoi_token_index=ids[2],
        )  # fmt: skip
    text = {**_TEXT, "max_position_embeddings": max_positions, "model_type": text_model}
    if text_model == "gemma2":
        text.update(sliding_window=56, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    query_pre_attn_scalar=16)  # fmt: skip
    return transformers.PaliGemmaConfig(
        text_config=text, vision_config={**_VISION, "patch_size": 8}, image_token_index=ids[0], projection_dim=64,
        hidden_size=64,
    )  # fmt: skip


def _processor(family: str) -> Any:
    if family == "gemma3":
        return transformers.Gemma3ImageProcessor(size={"height": 32, "width": 32})
    processor = transformers.SiglipImageProcessor(size={"height": 32, "width": 32})
    processor.image_seq_length = 16
    return processor


def _std(name: str) -> float:
    """Gemma scales token embeddings by sqrt(hidden) (8 here) and SigLIP normalises its output: small embeddings and
    a quiet tower leave the images, and the mask over them, visible in the tokens (equal stds give constant
    tokens and images that change nothing; tests assert both matter)."""
    if "embed_tokens" in name:
        return 0.02
    if "projector" in name:
        return 0.2
    return 0.3 if "language_model" in name else 0.05


def write_gemma_vlm_model(
    path: Path | str, family: str = "gemma3", *, seed: int = 0, text_model: str = "gemma", max_positions: int = 512
) -> Path:
    """Write the tiny ``family`` model (``gemma3``, ``paligemma``), the tiny tokenizer with the family's image
    tokens added and the image processor to ``path`` (``text_model``: PaliGemma's language model;
    ``max_positions``: the language model's ``max_position_embeddings``, larger for stock's 256 per Gemma 3 image)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    tokens = GEMMA3_TOKENS if family == "gemma3" else PALIGEMMA_TOKENS
    tokenizer.add_tokens([transformers.AddedToken(t, special=True) for t in tokens])
    config = _config(family, [tokenizer.convert_tokens_to_ids(t) for t in tokens], text_model, max_positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForImageTextToText.from_config(config)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # norms around 1 (Gemma's are 1 + w); the std of the rest: _std
            for name, param in sorted(model.named_parameters()):
                if "norm" in name and name.endswith("weight"):
                    param.copy_(0.1 * torch.randn(param.shape, generator=generator))
                else:
                    param.copy_(_std(name) * torch.randn(param.shape, generator=generator))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _processor(family).save_pretrained(path)
    return path


class GemmaVlmReference:
    """HF ``generate`` (float32, eager attention) with ``pixel_values`` and the processor's ``token_type_ids``:
    Gemma 3 marks the image tokens (1), PaliGemma the whole prompt as the prefix (0)."""

    def __init__(self, path: Path | str) -> None:
        self.model = (
            transformers.AutoModelForImageTextToText.from_pretrained(
                path, attn_implementation="eager", local_files_only=True
            )
            .float()
            .eval()
        )
        self.processor = transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True)
        self.prefix_lm = self.model.config.model_type == "paligemma"
        self.image_token_id = int(self.model.config.image_token_id)
        self._cache: dict[tuple[Any, ...], list[int]] = {}

    def greedy(self, prompt_ids: list[int], images: list[bytes], n: int) -> list[int]:
        """``n`` greedy tokens after ``prompt_ids`` (placeholders included) with ``images`` in order."""
        key = (tuple(prompt_ids), tuple(images), n)
        if key not in self._cache:
            x = torch.tensor([prompt_ids])
            types = torch.zeros_like(x) if self.prefix_lm else (x == self.image_token_id).long()
            kwargs: dict[str, Any] = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, token_type_ids=types)
            if images:
                pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
                kwargs["pixel_values"] = self.processor(pil, return_tensors="pt")["pixel_values"]
            with torch.no_grad():
                out = self.model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            self._cache[key] = out[0, x.shape[1] :].tolist()
        return self._cache[key]
