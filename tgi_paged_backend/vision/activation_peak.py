"""What the image side of a prefill adds to Warmup's activation peak (issue 40).

A prefill that reaches images first runs the vision tower over them (its own transient peak), then holds
their embeddings while the language model's forward runs over the chunk. Warmup therefore budgets
``max(vision tower peak, text prefill peak + held embeddings)`` for the largest number of images one
request may carry, each the largest image the anyres grid keeps whole (the largest-area grid
resolution: the most tiles and placeholders per image).
"""

from __future__ import annotations

from typing import Any

import torch
from loguru import logger


def largest_image(encoder: Any) -> Any:
    """A PIL image that gets the most placeholders of the encoder's family (its ``largest_image()``)."""
    return encoder.largest_image()


def warmup_image_count(encoder: Any, max_images: int, max_input_tokens: int | None) -> int:
    """How many largest images Warmup encodes: ``max_images``, fewer when ``max_input_tokens`` cannot hold
    that many images' placeholders (a request with more is refused, so no prefill encodes them). Matters for
    Qwen2-VL's processor (up to 16384 placeholders per image) more than for fixed-grid families."""
    if max_input_tokens is None:
        return max_images
    per_image = max(1, int(encoder.token_count(encoder.largest_image())))
    return max(1, min(max_images, max_input_tokens // per_image))


def vision_peak_bytes(encoder: Any, num_images: int, device: torch.device) -> tuple[int, int]:
    """``(peak, held)``: bytes the encode of ``num_images`` largest images needs at its peak (CUDA: measured
    with ``max_memory_allocated``; elsewhere the embeddings' bytes, a lower bound) and bytes of the
    embeddings it leaves held for the prefill."""
    images = [largest_image(encoder)] * num_images
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    features = encoder.encode(images)
    held = sum(f.numel() * f.element_size() for f in features)
    peak = held
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    del features
    return int(peak), int(held)


def with_vision_peak(text_peak: int, encoder: Any, num_images: int, device: torch.device) -> int:
    """Warmup's activation peak with the image side counted (see the module docstring)."""
    peak, held = vision_peak_bytes(encoder, num_images, device)
    total = max(peak, text_peak + held)
    logger.info(
        "vision tower: {} images of the largest grid, peak {:.1f} MiB, embeddings held {:.1f} MiB; activation "
        "peak {:.1f} -> {:.1f} MiB",
        num_images,
        peak / 2**20,
        held / 2**20,
        text_peak / 2**20,
        total / 2**20,
    )
    return total
