"""Tiny PEFT LoRA adapters for the tests, and HF + PEFT greedy references.

:func:`write_adapter` makes a real PEFT checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``)
with the ``peft`` package over a tiny base model; A and B are redrawn from ``seed`` (PEFT starts B at zero,
which would make every adapter the base model) with a scale that changes greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny_models import load_reference

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 4,
    alpha: float = 8.0,
    targets: Sequence[str] = LLAMA_TARGETS,
    seed: int = 0,
    std: float = 0.2,
    **lora_config: Any,
) -> Path:
    """Write a PEFT LoRA adapter of ``base_dir`` to ``out_dir`` and return it."""
    from peft import LoraConfig, get_peft_model

    base = load_reference(base_dir)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **lora_config)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                param.copy_(std * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out_dir)
    return Path(out_dir)


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by HF + PEFT (``adapter_dir`` ``None``: the base model alone)."""
    model = load_reference(base_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            generated = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(generated[0, len(ids) :].tolist())
    return out
