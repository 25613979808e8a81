"""The MoE MLP of a decoder layer as data for the native decode step, and its experts on the packed weights.

transformers' Mixtral and Qwen3-MoE blocks are a router (``gate``: a ``[E, H]`` weight, softmax over the experts,
each token's ``top_k``, renormalized over them or not) and experts holding ``gate_up_proj`` ``[E, 2I, H]`` and
``down_proj`` ``[E, H, I]`` with one activation: :func:`moe_parts` reads them (whether the router renormalizes is
found by running it on a random input, not read from the class), and Qwen2-MoE's shared expert (a gated MLP of
its own, fused, scaled by ``sigmoid`` of a one-row gate). A block with anything else (gpt-oss's interleaved,
biased, clamped experts) keeps the per-op path, with the reason.

Once a layer is native, its experts module becomes :class:`NativeExperts`, which runs every other step (prefill)
through the native GEMM on the same packed weights, the only copy kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tgi_paged_backend.runner.cpu.fast_layers import is_silu
from tgi_paged_backend.runner.parallel.row_parallel import RowParallelLinear
from tgi_paged_kernels import PACK_BLOCK, NativeKernels, gemm_packed, moe_experts


@dataclass(frozen=True, slots=True)
class MoeParts:
    """An MoE block's weights and routing, as the native step takes them."""

    router: torch.Tensor
    """``[E, H]``."""
    gate_up: torch.Tensor
    """``[E, 2I, H]``, each expert's gate rows first."""
    down: torch.Tensor
    """``[E, H, I]``."""
    act_fn: nn.Module
    top_k: int
    norm_top_k: bool
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, nn.Module] | None = None
    """Qwen2-MoE's shared expert: its ``[2 Is, H]`` gate/up, ``[H, Is]`` down, ``[1, H]`` sigmoid gate weights and
    its activation."""


def _renormalizes(router: nn.Module, weight: torch.Tensor, top_k: int) -> bool | None:
    """Whether ``router`` renormalizes its top-k weights, from one call on a random input (``None``: neither)."""
    x = torch.randn(7, weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = router(x)
        probs = F.softmax(F.linear(x, weight).float(), dim=-1)
    if not (isinstance(out, tuple) and len(out) == 3):
        return None
    top, _ = torch.topk(probs, top_k, dim=-1)
    for normalize in (True, False):
        want = top / top.sum(dim=-1, keepdim=True) if normalize else top
        if out[1].shape == want.shape and torch.allclose(out[1].float(), want, rtol=1e-5, atol=1e-6):
            return normalize
    return None


def moe_parts(mlp: Any) -> MoeParts | str:
    """The router and experts of a Mixtral-form MoE block (see the module docstring), or why it is not one."""
    router, experts = getattr(mlp, "gate", None) or getattr(mlp, "router", None), getattr(mlp, "experts", None)
    if type(experts).__name__ == "GptOssExperts":
        return "gpt-oss's experts (interleaved gate/up with biases, clamped SwiGLU) are not in the native step"
    shared = _shared_expert(mlp) if hasattr(mlp, "shared_expert") else None
    if isinstance(shared, str):
        return shared
    weight = getattr(router, "weight", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    top_k = getattr(router, "top_k", None)
    if not (
        isinstance(weight, torch.Tensor) and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    ) or not isinstance(top_k, int):
        return f"{type(mlp).__name__} is not a router with top_k and experts of stacked weights"
    num, hidden = weight.shape
    if (
        {t.dtype for t in (weight, gate_up, down)} != {torch.float32}
        or gate_up.dim() != 3
        or gate_up.shape[0] != num
        or gate_up.shape[2] != hidden
        or down.shape != (num, hidden, gate_up.shape[1] // 2)
        or any(getattr(experts, n, None) is not None for n in ("gate_up_proj_bias", "down_proj_bias"))
    ):
        return f"{type(experts).__name__}'s weights are not fp32 [E, 2I, H] / [E, H, I] without bias"
    act_fn = getattr(experts, "act_fn", None)
    normalize = _renormalizes(router, weight.detach(), top_k) if isinstance(router, nn.Module) else None
    if normalize is None or not isinstance(act_fn, nn.Module):
        return f"{type(router).__name__} is not a softmax top-k router, or its experts have no act_fn"
    return MoeParts(weight.detach(), gate_up.detach(), down.detach(), act_fn, top_k, normalize, shared)


def _shared_expert(mlp: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, nn.Module] | str:
    """The weights of Qwen2-MoE's shared expert (fused: one gate/up GEMM) and its one-row gate, or why not. A
    tensor-parallel rank's: its slice (down's columns under a row-parallel wrapper, summed with the block's output)."""
    expert, gate = mlp.shared_expert, getattr(mlp, "shared_expert_gate", None)
    gate_up, down = getattr(expert, "gate_up", None), getattr(expert, "down_proj", None)
    if isinstance(down, RowParallelLinear) and down.bias is None and getattr(down, "reduced_with_block", False):
        down = down.local
    linears = (gate_up, down, gate)
    if not all(type(m) is nn.Linear and m.bias is None and m.weight.dtype == torch.float32 for m in linears):
        return "its shared expert is not a fused gated MLP of plain fp32 linears with a one-row gate"
    assert isinstance(gate_up, nn.Linear) and isinstance(down, nn.Linear) and isinstance(gate, nn.Linear)
    if gate.out_features != 1:
        return "its shared expert's gate is not one row"
    return gate_up.weight.detach(), down.weight.detach(), gate.weight.detach(), expert.act_fn


class NativeExperts(nn.Module):
    """The experts of an MoE block on the native layer's packed weights: ``forward(x, top_k_index,
    top_k_weights)`` as transformers' experts module (each hit expert's gated MLP on its rows, weighted, added in
    expert order), its two GEMMs the native packed GEMM."""

    def __init__(
        self, gate_up: torch.Tensor, down: torch.Tensor, experts: int, intermediate: int, act_fn: nn.Module,
        native: NativeKernels,
    ) -> None:  # fmt: skip
        super().__init__()
        self.packed = (gate_up, down)
        self.gate_up, self.down = gate_up.view(experts, -1, *gate_up.shape[1:]), down.view(experts, -1, *down.shape[1:])
        self.num_experts, self.intermediate = experts, intermediate
        self.act_fn = act_fn
        self.native = native
        self.silu = is_silu(act_fn)
        """SiLU: the whole sum in one native call (:func:`~tgi_paged_kernels.moe_experts`) for fp32 rows."""
        self.resident_bytes = (gate_up.numel() + down.numel()) * gate_up.element_size()

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.silu and hidden.dtype == torch.float32 and top_k_weights.dtype == torch.float32:
            rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
            index = top_k_index.reshape(rows.shape[0], top_k_index.shape[-1]).to(torch.int64).contiguous()
            weights = top_k_weights.reshape(rows.shape[0], top_k_weights.shape[-1]).contiguous()
            out = moe_experts(self.native, rows, index, weights, *self.packed, self.intermediate)
            return out.view(hidden.shape)
        out = torch.zeros_like(hidden)
        rows_in, width = hidden.reshape(-1, hidden.shape[-1]), hidden.shape[-1]
        for e in torch.unique(top_k_index).tolist():
            if e >= self.num_experts:  # no expert (expert parallelism's mark), as transformers' experts skip it
                continue
            tokens, slot = torch.where(top_k_index == e)
            x = rows_in[tokens].float().contiguous()  # a bf16 model's rows widened: the GEMMs sum in fp32
            gate_up = gemm_packed(self.native, x, self.gate_up[e], 2 * self.intermediate)
            product = self.native.silu_and_mul(gate_up) if self.silu else None
            if product is None:
                gate, up = gate_up.chunk(2, dim=-1)
                product = (self.act_fn(gate) * up).contiguous()
            y = gemm_packed(self.native, product, self.down[e], width)
            out.index_add_(0, tokens, (y * top_k_weights[tokens, slot, None].to(y.dtype)).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, intermediate={self.intermediate}, packed by {PACK_BLOCK} columns"
