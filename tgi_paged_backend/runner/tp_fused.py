"""Tensor-parallel slices of fused projections: one GEMM whose output rows are several projections side by side.

Phi-3's ``qkv_proj`` holds q, k and v, and its ``gate_up_proj`` holds gate and up. A contiguous cut of the
fused matrix would give rank 0 all of q and rank 1 k and v. Instead, each rank keeps its own share of every
part, side by side in the same order. The module's forward then splits the local output exactly as it split
the full one, as long as the sizes it splits by are the local ones (see ``shard_model``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tgi_paged_backend.runner.model_loader import ModelLoadError


def fused_row_slices(sizes: Sequence[int], rank: int, world_size: int, what: str) -> list[slice]:
    """This rank's rows of each part of a fused output whose parts have ``sizes`` rows, in part order."""
    slices, start = [], 0
    for size in sizes:
        if size % world_size:
            raise ModelLoadError(f"{what}: a fused part of {size} rows is not divisible by {world_size}")
        width = size // world_size
        slices.append(slice(start + rank * width, start + (rank + 1) * width))
        start += size
    return slices


def shard_fused_linear(linear: nn.Module, sizes: Sequence[int], rank: int, world_size: int, what: str) -> nn.Linear:
    """A new ``nn.Linear`` with this rank's rows of each part of ``linear`` (a plain fused linear)."""
    if type(linear) is not nn.Linear:
        raise ModelLoadError(
            f"tensor parallelism: {what} is a fused {type(linear).__name__}; only plain fused linears are "
            "sliced per part (quantized fused projections are not): use --num-shard 1"
        )
    if sum(sizes) != linear.out_features:
        raise ModelLoadError(f"{what}: parts {list(sizes)} do not add up to {linear.out_features} outputs")
    rows = fused_row_slices(sizes, rank, world_size, what)
    weight = torch.cat([linear.weight.detach()[r] for r in rows])
    local = nn.Linear(linear.in_features, int(weight.shape[0]), bias=linear.bias is not None)
    local.weight = nn.Parameter(weight.clone(), requires_grad=False)
    if linear.bias is not None:
        local.bias = nn.Parameter(torch.cat([linear.bias.detach()[r] for r in rows]).clone(), requires_grad=False)
    return local.to(linear.weight.device)
