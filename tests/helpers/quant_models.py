"""Quantized test checkpoints written here, and the dequantized HF models they are compared against.

- :func:`write_compressed_fp8` turns a tiny model directory into a compressed-tensors FP8 checkpoint in
  its real on-disk layout (``weight`` float8_e4m3fn + ``weight_scale``, ``lm_head`` ignored, the
  ``quantization_config`` llm-compressor writes), with our own quantizer: per output channel
  (``channel``) or one scale per tensor (``tensor``).
- :func:`dequantized_reference` is the plain HF model whose quantized linears hold exactly
  ``q * scale`` (quantize, then dequantize): what a token-exact test compares our quantized forward with.

``tests/helpers/compressed_tensors_check.py`` reads such a checkpoint back with the independent
``compressed-tensors`` library, where it is installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tgi_paged_backend.runner.quant.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, quantize_fp8_per_channel
from tgi_paged_kernels.fp8_gemm import dequantize_fp8

STRATEGIES = ("channel", "tensor")


def quantize(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, ``[N]`` float32 scales) for ``strategy``; ``tensor`` repeats one scale N times."""
    if strategy == "channel":
        return quantize_fp8_per_channel(weight)
    w = weight.detach().float()
    scale = (w.abs().amax() / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.reshape(1).expand(w.shape[0]).contiguous()


def linear_names(model_dir: Path) -> list[str]:
    """Every ``nn.Linear`` of the model but the output head, subclasses included (Falcon's ``FalconLinear``): what
    ``--quantize fp8`` quantizes."""
    from tests.helpers.tiny_models import load_reference

    model = load_reference(model_dir)
    head = model.get_output_embeddings()
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]


def quantization_config(strategy: str, dynamic_activations: bool = False) -> dict:
    """The ``quantization_config`` llm-compressor writes for FP8 (``FP8_DYNAMIC`` with activations)."""
    acts = (
        {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
        if dynamic_activations
        else None
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": acts,
                "output_activations": None,
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "symmetric": True,
                    "dynamic": False,
                    "group_size": None,
                    "block_structure": None,
                    "actorder": None,
                    "observer": "minmax",
                },
            }
        },
    }


def write_compressed_fp8(src: Path, dst: Path, strategy: str = "channel", *, dynamic_activations: bool = False) -> Path:
    """Copy ``src`` (a tiny model dir) to ``dst`` as a compressed-tensors FP8 checkpoint."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    for name in linear_names(src):
        q, scale = quantize(tensors[f"{name}.weight"], strategy)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale"] = scale[:1].clone() if strategy == "tensor" else scale.unsqueeze(1)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(strategy, dynamic_activations)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def dequantized_reference(src: Path, strategy: str = "channel", loaded: torch.dtype = torch.float32) -> torch.nn.Module:
    """The fp32 HF model of ``src`` with every quantized linear's weight replaced by ``q * scale``, quantized from
    the weights as a model of dtype ``loaded`` holds them (``--quantize fp8 --dtype bfloat16`` quantizes bf16
    weights)."""
    from tests.helpers.tiny_models import load_reference

    model = load_reference(src)
    with torch.no_grad():
        for name in linear_names(src):
            linear = model.get_submodule(name)
            q, scale = quantize(linear.weight.to(loaded), strategy)
            linear.weight.copy_(dequantize_fp8(q, scale, linear.weight.dtype))
    return model
