"""The packed GEMMs of the native CPU layer (``csrc/cpu_gemm.h``, ``csrc/cpu_gemm_bf16.h``,
``csrc/cpu_gemm_amx.h``): weight packing and the ``x @ W.T (+ bias)`` call, for fp32 and bf16 weights.

A ``[N, K]`` weight is packed once, in column blocks of 16 (:data:`PACK_BLOCK`, zero-padded):

- fp32 (:func:`pack_weight`): ``[ceil(N / 16), K, 16]``;
- bf16 (:func:`pack_weight_bf16`): ``[ceil(N / 16), ceil(K / 2), 16, 2]``, each column's ``k`` pairs side by side
  (the VNNI layout ``vdpbf16ps`` reads; ``K`` padded to even with zeros). Three arithmetics, fp32 sums each:
  where the host has AMX-BF16 (and Linux lends the tiles), AMX tiles at every row count (``csrc/cpu_gemm_amx.h``;
  :func:`set_bf16_amx`); else on AVX512-BF16 cores of AMD's, ``vdpbf16ps`` (``csrc/cpu_gemm_bf16_dot.h``;
  :func:`set_bf16_dot`: on by default there, 1.7x the widening path's speed on a Zen 4 core, slower on Intel's);
  these two round the activations to bf16, as a torch bf16 model holds them. Otherwise the weights are widened in
  registers (exact) and summed by fp32 fused multiply-adds: the bits of the fp32 GEMM on the widened weights, at
  half its weight bytes. :attr:`NativeKernels.gemm_bf16_rounds_activations` says which arithmetic runs, and the
  reference :func:`.cpu_layer_ref.gemm_packed_bf16_ref` models each.
"""

from __future__ import annotations

import torch

from ._checks import cdiv
from .cpu_native import NativeKernels

PACK_BLOCK = 16
"""Columns per packed block (``kNB`` in the C++)."""


def set_bf16_amx(native: NativeKernels, on: bool | None = None) -> bool:
    """Turn the AMX bf16 GEMM on (the default) or off (the widening path) for this process and library, or leave it
    (``None``); returns whether AMX now runs (``False`` where the build or the OS has no AMX tiles)."""
    return bool(native.gemm_bf16_amx(-1 if on is None else int(on)))


def set_bf16_dot(native: NativeKernels, on: bool | None = None) -> bool:
    """Turn the ``vdpbf16ps`` bf16 GEMM on or off (the widening path) for this process and library, or leave it
    (``None``); returns whether it is now on (``False`` where the build has no AVX512-BF16). AMX, where it runs,
    comes first."""
    return bool(native.gemm_bf16_dot(-1 if on is None else int(on)))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 ``[N, K]`` weight as ``[ceil(N / 16), K, 16]`` (columns zero-padded), the GEMM's layout."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"pack_weight: needs an fp32 [N, K] weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    padded = torch.zeros((-(-n // PACK_BLOCK) * PACK_BLOCK, k), dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(-1, PACK_BLOCK, k).transpose(1, 2).contiguous()


def bf16_from_packed(packed: torch.Tensor) -> torch.Tensor:
    """fp32 packed blocks ``[B, K, 16]`` (:func:`pack_weight`; a stack of experts' too) as bf16 packed blocks
    ``[B, ceil(K / 2), 16, 2]``, the values rounded to bf16 (exact for a bf16 model's weights widened to fp32)."""
    if packed.dtype != torch.float32 or packed.dim() != 3 or packed.shape[2] != PACK_BLOCK:
        raise ValueError(f"bf16_from_packed: needs fp32 packed blocks [B, K, 16], got {tuple(packed.shape)}")
    blocks, k, _ = packed.shape
    padded = torch.zeros((blocks, 2 * cdiv(k, 2), PACK_BLOCK), dtype=torch.float32)
    padded[:, :k] = packed
    pairs = padded.view(blocks, -1, 2, PACK_BLOCK).transpose(2, 3)
    return pairs.to(torch.bfloat16).contiguous()


def pack_weight_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A ``[N, K]`` weight (fp32 rounded to bf16, or bf16) as ``[ceil(N / 16), ceil(K / 2), 16, 2]`` bf16."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2:
        raise ValueError(f"pack_weight_bf16: needs an fp32 or bf16 [N, K] weight, got {weight.dtype}")
    return bf16_from_packed(pack_weight(weight.detach().float()))


def unpack_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The ``[n, k]`` weight (fp32 or bf16, as packed) of a :func:`pack_weight` or :func:`pack_weight_bf16`
    packing; a view where the layout allows."""
    if packed.dtype == torch.bfloat16:
        return packed.transpose(2, 3).reshape(packed.shape[0], -1, PACK_BLOCK)[:, :k].transpose(1, 2).reshape(-1, k)[:n]
    return packed.transpose(1, 2).reshape(-1, k)[:n]


def packed_shape(n: int, k: int, dtype: torch.dtype, experts: int = 1) -> tuple[int, ...]:
    """The shape of ``experts`` stacked ``[n, k]`` weights packed in ``dtype`` (fp32 or bf16)."""
    blocks = experts * cdiv(n, PACK_BLOCK)
    return (blocks, k, PACK_BLOCK) if dtype == torch.float32 else (blocks, cdiv(k, 2), PACK_BLOCK, 2)


def gemm_packed(
    native: NativeKernels, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` (fp32) for fp32 ``x`` ``[M, K]`` (rows contiguous) and ``W`` packed by
    :func:`pack_weight` or :func:`pack_weight_bf16` (the packing's dtype picks the GEMM)."""
    m, k = x.shape
    if (
        x.dtype != torch.float32
        or x.stride(-1) != 1
        or packed.dtype not in (torch.float32, torch.bfloat16)
        or not packed.is_contiguous()
        or packed.shape[0] * PACK_BLOCK < n
        or packed.shape[1:] != packed_shape(n, k, packed.dtype)[1:]
        or (bias is not None and (bias.dtype != torch.float32 or bias.numel() < n or not bias.is_contiguous()))
    ):
        raise ValueError(f"gemm_packed: x {tuple(x.shape)} {x.dtype} does not fit a packed {tuple(packed.shape)}")
    out = torch.empty((m, n), dtype=torch.float32)
    gemm = native.gemm_packed if packed.dtype == torch.float32 else native.gemm_packed_bf16
    gemm(
        x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), n, None if bias is None else bias.data_ptr(), None, 0,
        out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return out


def moe_experts(
    native: NativeKernels, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    gate_up: torch.Tensor, down: torch.Tensor, intermediate: int,
) -> torch.Tensor:  # fmt: skip
    """An MoE block's SiLU experts given the router's picks, as transformers' experts module sums them: for fp32
    ``x`` ``[T, H]``, ``top_k_index`` (int64) and ``top_k_weights`` (fp32) ``[T, k]``, each hit expert ``e``'s
    ``down_e(silu(gate_e(x)) * up_e(x))`` on its rows, weighted, added in expert order (``[T, H]`` fp32). The
    experts' weights are stacked packings (:func:`packed_shape` with ``experts``): gate/up ``[2I, H]`` each, gate
    rows first, and down ``[H, I]``, fp32 or bf16. A pick of ``E`` (the expert count) is no expert, as transformers'
    experts skip it. Raises ``ValueError`` for other inputs or a pick outside ``[0, E]`` (or one expert picked twice
    by a token)."""
    t, h = x.shape
    k = top_k_index.shape[-1]
    experts = gate_up.shape[0] // cdiv(2 * intermediate, PACK_BLOCK)
    if (
        x.dtype != torch.float32
        or not x.is_contiguous()
        or top_k_index.dtype != torch.int64
        or top_k_weights.dtype != torch.float32
        or top_k_index.shape != (t, k)
        or top_k_weights.shape != (t, k)
        or not (top_k_index.is_contiguous() and top_k_weights.is_contiguous())
        or gate_up.dtype not in (torch.float32, torch.bfloat16)
        or down.dtype != gate_up.dtype
        or gate_up.shape != packed_shape(2 * intermediate, h, gate_up.dtype, experts)
        or down.shape != packed_shape(h, intermediate, down.dtype, experts)
        or not (gate_up.is_contiguous() and down.is_contiguous())
    ):
        raise ValueError(
            f"moe_experts: x {tuple(x.shape)} {x.dtype}, picks {tuple(top_k_index.shape)} {top_k_index.dtype}, "
            f"do not fit experts packed as {tuple(gate_up.shape)} / {tuple(down.shape)} {gate_up.dtype}"
        )
    out = torch.empty((t, h), dtype=torch.float32)
    scratch = torch.empty(t * (2 * h + 3 * intermediate), dtype=torch.float32)
    status = native.moe_experts(
        x.data_ptr(), t, h, top_k_index.data_ptr(), top_k_weights.data_ptr(), k, experts, intermediate,
        int(gate_up.dtype == torch.bfloat16), gate_up.data_ptr(), down.data_ptr(), scratch.data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(
            f"moe_experts: a pick outside the {experts} experts (or {experts}: none), "
            "or one expert picked twice by a token"
        )
    return out
