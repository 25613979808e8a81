"""The packed GEMMs of the native CPU layer (``csrc/cpu_gemm.h``, ``csrc/cpu_gemm_bf16.h``,
``csrc/cpu_gemm_amx.h``): weight packing and the ``x @ W.T (+ bias)`` call, for fp32 and bf16 weights.

A ``[N, K]`` weight is packed once, in column blocks of 16 (:data:`PACK_BLOCK`, zero-padded):

- fp32 (:func:`pack_weight`): ``[ceil(N / 16), K, 16]``;
- bf16 (:func:`pack_weight_bf16`): ``[ceil(N / 16), ceil(K / 2), 16, 2]``, each column's ``k`` pairs side by side
  (the VNNI layout ``vdpbf16ps`` reads; ``K`` padded to even with zeros). Activations stay fp32, sums fp32: the
  weights are widened in registers (exact) and summed by fp32 fused multiply-adds, the bits of the fp32 GEMM on
  the widened weights, at half its weight bytes. A build with ``-DTGI_PAGED_BF16_DOT`` on AVX512-BF16 rounds
  activation pairs to bf16 and sums them with ``vdpbf16ps`` instead (slower on the cores we measured:
  ``csrc/cpu_gemm_bf16.h``). Where the host has AMX-BF16 (and Linux lends the tiles), the bf16 GEMM runs on AMX
  tiles at every row count (``csrc/cpu_gemm_amx.h``): activations rounded to bf16, as a torch bf16 model holds
  them, fp32 sums; :func:`set_bf16_amx` turns it off and on. :attr:`NativeKernels.gemm_bf16_rounds_activations`
  says which arithmetic runs, and the reference :func:`.cpu_layer_ref.gemm_packed_bf16_ref` models each.
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
