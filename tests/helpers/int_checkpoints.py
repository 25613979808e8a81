"""Int4/int8 test checkpoints in GPTQ, AWQ and compressed-tensors ``pack-quantized`` layouts, written here.

Our own min-max quantizer turns every non-head linear of a tiny model into integer codes, per-group
scales and zero points; each writer then packs them into that format's real on-disk tensors and
``quantization_config`` (see ``tgi_paged_backend/runner/quant/gptq_awq.py`` and ``pack_quantized.py``
for the layouts, verified against TGI, transformers and compressed-tensors). The packing is written
independently of the loader's unpacking: explicit per-field shifts into numpy ``uint32`` words here,
reshaped shifts there. :class:`IntCheckpoint` keeps the codes and the dequantized fp32 weights
``(q - z) * s``, which :func:`int_reference` puts into a plain HF model: what a token-exact test
compares our quantized forward with.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.quant_models import linear_names

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field j of a word holds output 8c + AWQ_ORDER[j]


@dataclass
class IntCheckpoint:
    path: Path
    fmt: str
    bits: int
    group_size: int
    codes: dict[str, torch.Tensor] = field(default_factory=dict)
    """Unsigned codes ``[N, K]`` of each quantized linear."""
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    """The dequantized fp32 weight ``(q - z) * s`` of each quantized linear."""
    g_idx: dict[str, torch.Tensor] = field(default_factory=dict)


def quantize_groups(
    weight: torch.Tensor, bits: int, g_idx: torch.Tensor, groups: int, sym: bool, scale_dtype: torch.dtype
):
    """Min-max quantization per (output channel, group): unsigned codes, zeros and scales (``scale_dtype``)."""
    w = weight.detach().float()
    maxq = (1 << bits) - 1
    n = w.shape[0]
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.int32)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scales[:, g] = (cols.abs().amax(dim=1) / (maxq / 2)).clamp(min=1e-8)
            zeros[:, g] = 1 << (bits - 1)
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scales[:, g] = ((hi - lo) / maxq).clamp(min=1e-8)
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(0, maxq).to(torch.int32)
    scales = scales.to(scale_dtype).float()  # the stored precision is what dequantizes
    gi = g_idx.long()
    codes = torch.round(w / scales[:, gi]) + zeros[:, gi]
    codes = codes.clamp(0, maxq).to(torch.int32)
    deq = (codes - zeros[:, gi]).float() * scales[:, gi]
    return codes, zeros, scales.to(scale_dtype), deq


def _pack_fields(values: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack ``values`` (unsigned, < 2^bits) into int32 words along ``axis``: field ``j`` of word ``c`` is
    element ``c * p + order[j]`` (``order`` defaults to ``j``), least significant field first."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    words = np.zeros((-(-v.shape[0] // per), *v.shape[1:]), dtype=np.uint32)
    for c in range(words.shape[0]):
        for j in range(per):
            src = c * per + (order[j] if order else j)
            if src < v.shape[0]:
                words[c] |= v[src] << np.uint32(bits * j)
    return torch.from_numpy(np.moveaxis(words, 0, axis).copy().view(np.int32))


def _copy_dir(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)


def gptq_config(bits: int, group_size: int, desc_act: bool, sym: bool) -> dict:
    """The ``quantization_config`` GPTQModel writes into ``config.json`` (v1 ``gptq`` format)."""
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "damp_percent": 0.01,
        "true_sequential": True,
        "static_groups": False,
        "lm_head": False,
        "checkpoint_format": "gptq",
        "meta": {"quantizer": ["tests.helpers.int_checkpoints"]},
    }


def awq_config(group_size: int) -> dict:
    """The ``quantization_config`` AutoAWQ writes for GEMM checkpoints."""
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }


def pack_quantized_config(bits: int, group_size: int | None, sym: bool) -> dict:
    """The ``quantization_config`` llm-compressor writes for W4A16 / W8A16 (``pack-quantized``)."""
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": sym,
        "strategy": "channel" if group_size is None else "group",
        "group_size": group_size,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "block_structure": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
    }


def write_int_checkpoint(
    src: Path,
    dst: Path,
    fmt: str,
    *,
    bits: int = 4,
    group_size: int = 32,
    sym: bool = False,
    desc_act: bool = False,
    seed: int = 0,
) -> IntCheckpoint:
    """Copy ``src`` (a tiny model dir) to ``dst`` as a ``fmt`` (``gptq``, ``awq``, ``pack-quantized``) int
    checkpoint; ``group_size`` -1 is one group per channel (``channel`` strategy for pack-quantized)."""
    _copy_dir(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    ckpt = IntCheckpoint(dst, fmt, bits, group_size)
    gen = torch.Generator().manual_seed(seed)
    scale_dtype = torch.float16 if fmt in ("gptq", "awq") else tensors[f"{linear_names(src)[0]}.weight"].dtype
    for name in linear_names(src):
        weight = tensors.pop(f"{name}.weight")
        n, k = weight.shape
        groups = 1 if group_size == -1 else k // group_size
        g_idx = (
            torch.zeros(k, dtype=torch.int32)
            if group_size == -1
            else (torch.arange(k, dtype=torch.int32) // group_size).to(torch.int32)
        )
        if desc_act:  # act-order: column perm[i] is the i-th quantized, in group i // group_size
            perm = torch.randperm(k, generator=gen)
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[perm] = (torch.arange(k) // group_size).to(torch.int32)
        codes, zeros, scales, deq = quantize_groups(weight, bits, g_idx, groups, sym, scale_dtype)
        ckpt.codes[name], ckpt.weights[name], ckpt.g_idx[name] = codes.to(torch.uint8), deq, g_idx
        c, z = codes.numpy(), zeros.numpy()
        maxq = (1 << bits) - 1
        if fmt == "gptq":
            tensors[f"{name}.qweight"] = _pack_fields(c.T, bits, axis=0)  # [K/p, N]
            tensors[f"{name}.qzeros"] = _pack_fields((z.T - 1) & maxq, bits, axis=1)  # [G, N/p], zero - 1
            tensors[f"{name}.scales"] = scales.t().contiguous()  # [G, N] fp16
            tensors[f"{name}.g_idx"] = g_idx.clone()
        elif fmt == "awq":
            tensors[f"{name}.qweight"] = _pack_fields(c.T, 4, axis=1, order=AWQ_ORDER)  # [K, N/8]
            tensors[f"{name}.qzeros"] = _pack_fields(z.T, 4, axis=1, order=AWQ_ORDER)  # [G, N/8]
            tensors[f"{name}.scales"] = scales.t().contiguous()
        elif fmt == "pack-quantized":  # signed q = code - 2^(bits-1) is stored as code: the offset cancels
            tensors[f"{name}.weight_packed"] = _pack_fields(c, bits, axis=1)  # [N, K/p]
            tensors[f"{name}.weight_scale"] = scales.contiguous()  # [N, G]
            tensors[f"{name}.weight_shape"] = torch.tensor([n, k])
            if not sym:
                tensors[f"{name}.weight_zero_point"] = _pack_fields(z, bits, axis=0)  # [N/p, G]
        else:
            raise ValueError(f"fmt={fmt!r}")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = (
        gptq_config(bits, group_size, desc_act, sym)
        if fmt == "gptq"
        else awq_config(group_size)
        if fmt == "awq"
        else pack_quantized_config(bits, None if group_size == -1 else group_size, sym)
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return ckpt


def int_reference(src: Path, ckpt: IntCheckpoint) -> torch.nn.Module:
    """The fp32 HF model of ``src`` with every quantized linear's weight replaced by ``(q - z) * s``."""
    from tests.helpers.tiny_models import load_reference

    model = load_reference(src)
    with torch.no_grad():
        for name, weight in ckpt.weights.items():
            model.get_submodule(name).weight.copy_(weight)
    return model
