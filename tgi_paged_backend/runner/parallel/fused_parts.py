"""Tensor-parallel slices of fused projections: one GEMM whose output rows are several projections side by side.

Phi-3's ``qkv_proj`` holds q, k and v, and its ``gate_up_proj`` holds gate and up. A contiguous cut of the
fused matrix would give rank 0 all of q and rank 1 k and v. Instead, each rank keeps its own share of every
part, side by side in the same order. The module's forward then splits the local output exactly as it split
the full one, as long as the sizes it splits by are the local ones (see ``shard_model``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from tgi_paged_backend.runner.model.loader import ModelLoadError
from tgi_paged_backend.runner.quant.linear import QUANTIZED_LINEARS


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


def shard_fused_linear(linear: nn.Module, sizes: Sequence[int], rank: int, world_size: int, what: str) -> nn.Module:
    """A new linear with this rank's rows of each part of ``linear`` (plain, fp8 or int)."""
    out_features = getattr(linear, "out_features", None)
    if sum(sizes) != out_features:
        raise ModelLoadError(f"{what}: parts {list(sizes)} do not add up to {out_features} outputs")
    return take_rows(linear, fused_row_slices(sizes, rank, world_size, what), what)


def take_rows(linear: nn.Module, rows: Sequence[slice], what: str) -> nn.Module:
    """A new linear of ``linear``'s output rows ``rows``, side by side: an ``nn.Linear`` for a plain one, the
    same quantized class (its codes, scales and zeros of those rows) for an ``Fp8Linear``/``IntLinear``."""
    if isinstance(linear, QUANTIZED_LINEARS):
        return linear.output_rows(rows)
    kind = type(linear)
    # nn.Linear, or a subclass that only changes the forward (transformers' FalconLinear: matmul, then bias)
    if not (isinstance(linear, nn.Linear) and kind.__init__ is nn.Linear.__init__):
        raise ModelLoadError(
            f"tensor parallelism: {what} is a {kind.__name__}, not a linear layer this slicing knows: use --num-shard 1"
        )
    weight = torch.cat([linear.weight.detach()[r] for r in rows])
    local = kind(linear.in_features, int(weight.shape[0]), bias=linear.bias is not None)
    local.weight = nn.Parameter(weight.clone(), requires_grad=False)
    if linear.bias is not None:
        local.bias = nn.Parameter(torch.cat([linear.bias.detach()[r] for r in rows]).clone(), requires_grad=False)
    return local.to(linear.weight.device)


def shard_experts(experts: nn.Module, rank: int, world_size: int, what: str) -> None:
    """Cut every expert's intermediate dimension (in place): ``gate_up_proj`` ``[E, 2I, H]`` keeps this rank's
    rows of gate and of up side by side, ``down_proj`` ``[E, H, I]`` its columns. The router stays whole, so
    every rank routes each token to the same experts, and the sum of the ranks' outputs (one all-reduce
    after the block) is the full output: each expert's down projection is linear in its intermediate."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.ndim == down.ndim == 3):
        raise ModelLoadError(f"tensor parallelism: {what} is not an experts module of [E, 2I, H] / [E, H, I] weights")
    if type(experts).__name__ == "GptOssExperts":
        _shard_interleaved_experts(experts, gate_up, down, rank, world_size, what)
        return
    num_experts, two_i, hidden = gate_up.shape
    if down.shape != (num_experts, hidden, two_i // 2) or any(
        getattr(experts, name, None) is not None for name in ("gate_up_proj_bias", "down_proj_bias")
    ):
        raise ModelLoadError(
            f"tensor parallelism: {what} has another experts layout ({tuple(gate_up.shape)}, {tuple(down.shape)}, "
            "or biases): use --num-shard 1"
        )
    rows = fused_row_slices((two_i // 2, two_i // 2), rank, world_size, what)
    experts.gate_up_proj = nn.Parameter(
        torch.cat([gate_up.detach()[:, r] for r in rows], dim=1).clone(), requires_grad=False
    )
    experts.down_proj = nn.Parameter(down.detach()[:, :, rows[0]].clone(), requires_grad=False)
    if isinstance(getattr(experts, "intermediate_dim", None), int):
        experts.intermediate_dim = two_i // 2 // world_size  # type: ignore[assignment]


def _shard_interleaved_experts(
    experts: nn.Module, gate_up: torch.Tensor, down: torch.Tensor, rank: int, world_size: int, what: str
) -> None:
    """gpt-oss: ``gate_up_proj`` ``[E, H, 2I]`` (``x @ W``) with gate and up interleaved (columns 2j, 2j + 1),
    ``down_proj`` ``[E, I, H]``, biases. A rank's intermediate units ``j`` are a contiguous run of column pairs;
    the down bias stays on rank 0 only (the all-reduce adds it once)."""
    num_experts, hidden, two_i = gate_up.shape
    if down.shape != (num_experts, two_i // 2, hidden) or (two_i // 2) % world_size:
        raise ModelLoadError(f"tensor parallelism: {what}: {tuple(gate_up.shape)} / {tuple(down.shape)} do not split")
    width = two_i // 2 // world_size
    units = slice(rank * width, (rank + 1) * width)
    pairs = slice(2 * units.start, 2 * units.stop)

    def param(tensor: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(tensor.clone(), requires_grad=False)

    gate_up_bias, down_bias = (
        cast(torch.Tensor, getattr(experts, n)).detach() for n in ("gate_up_proj_bias", "down_proj_bias")
    )
    experts.gate_up_proj = param(gate_up.detach()[:, :, pairs])
    experts.gate_up_proj_bias = param(gate_up_bias[:, pairs])
    experts.down_proj = param(down.detach()[:, units])
    experts.down_proj_bias = param(down_bias if rank == 0 else torch.zeros_like(down_bias))
    if isinstance(getattr(experts, "intermediate_size", None), int):
        experts.intermediate_size = width  # type: ignore[assignment]


class ReducedOutput(nn.Module):
    """``all_reduce(block(x))``: a block whose ranks each compute a part of the output (a sharded MoE block)."""

    def __init__(self, block: nn.Module, all_reduce) -> None:  # noqa: ANN001 - AllReduce, see tensor_parallel
        super().__init__()
        self.block = block
        self._all_reduce = all_reduce

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - the block's own signature
        out = self.block(*args, **kwargs)
        if isinstance(out, tuple):  # (hidden, router logits) in some versions
            return (self._all_reduce(out[0]), *out[1:])
        return self._all_reduce(out)
