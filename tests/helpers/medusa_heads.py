"""Tiny Medusa checkpoints in the on-disk layout stock TGI reads (``runner.model.medusa``), over a tiny base model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.helpers.tiny_models import load_reference

NUM_HEADS = 4


def write_medusa(path: Path, base: Path, *, own_out: bool, seed: int = 0, scale: float = 0.5) -> dict:
    """A Medusa checkpoint of ``NUM_HEADS`` one-block heads over ``base``; returns its tensors. With
    ``own_out`` every head has its own projection: the base ``lm_head``'s plus noise for the even heads
    (so their drafts are sometimes right), random for the odd ones."""
    reference = load_reference(base)
    text = reference.config.get_text_config()
    hidden, vocab = int(text.hidden_size), int(text.vocab_size)
    g = torch.Generator().manual_seed(seed)
    lm_head = reference.get_output_embeddings().weight.detach()
    tensors = {}
    for i in range(NUM_HEADS):
        tensors[f"{i}.0.linear.weight"] = torch.randn(hidden, hidden, generator=g) * scale / hidden**0.5
        tensors[f"{i}.0.linear.bias"] = torch.randn(hidden, generator=g) * 0.2 * scale
        if own_out:
            noise = torch.randn(vocab, hidden, generator=g) / hidden**0.5
            tensors[f"{i}.1.weight"] = lm_head + 0.05 * noise if i % 2 == 0 else noise
    path.mkdir(parents=True)
    save_file(tensors, str(path / "medusa_lm_head.safetensors"))
    (path / "config.json").write_text(
        json.dumps({"medusa_num_heads": NUM_HEADS, "medusa_num_layers": 1, "base_model_name_or_path": str(base)})
    )
    return tensors
