"""The native CPU GEMM on one-byte weights (int8, fp8 e4m3) dequantized inside its tile (``csrc/cpu_gemm_quant.h``),
with its torch reference.

The weights are the repo's int8 format (:class:`~tgi_paged_backend.runner.quant.linear.IntLinear` of 8 bits:
uint8 codes ``[N, K]``, fp32 ``scales`` and uint8 ``zeros`` ``[N, G]``, ``g_idx`` ``[K]``; GPTQ, compressed-tensors
``pack-quantized``) with one group per output channel (``G == 1``: per-output-channel scales). :func:`pack_int8`
lays the codes out as :func:`.cpu_layer.pack_weight` lays fp32 weights out (``[ceil(N / 16), K, 16]``, one byte
each) with each column's zero point and scale beside them; :func:`gemm_packed_int8` computes
``x @ ((codes - zeros) * scales).T (+ bias)``, each weight's value the one :func:`.int_gemm.dequantize_int` gives
(``code - zero`` exact, one rounding), summed as the fp32 GEMM sums (bit for bit its result on the dequantized
weight). A decode step streams a quarter of the fp32 weight's bytes.

fp8 e4m3 weights of one scale per output channel (:class:`~tgi_paged_backend.runner.quant.linear.Fp8Linear`:
``--quantize fp8``, compressed-tensors FP8 ``channel``) pack the same way (:func:`pack_fp8`: the e4m3 bytes as codes,
``zeros`` unused); each weight is ``e4m3(code) * scale``, :func:`.fp8_gemm.dequantize_fp8`'s value.

The native decoder layer runs int8 and fp8 projections the same way (``LayerSpec.weight_dtype`` 2 and 3):
:func:`pack_int8_layer`.

Reference (the specification; ``tests/kernels/test_cpu_gemm_quant.py`` compares them): :func:`gemm_packed_int8_ref`;
a layer's: :func:`.cpu_layer_ref.decode_layer_ref` on the :func:`dequantized_int8` weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .cpu_layer import PACK_BLOCK, LayerForm, LayerWeights
from .cpu_native import NativeKernels


@dataclass(frozen=True, slots=True)
class PackedInt8:
    """A one-byte ``[N, K]`` weight (int8 codes, or fp8 e4m3 bytes) packed for :func:`gemm_packed_int8` (CPU
    tensors)."""

    codes: torch.Tensor
    """uint8 ``[ceil(N / 16), K, 16]`` (padding columns 0)."""
    zeros: torch.Tensor
    """fp32 ``[ceil(N / 16) * 16]``: each column's zero point (padding 0; fp8: all 0, unused)."""
    scales: torch.Tensor
    """fp32 ``[ceil(N / 16) * 16]``: each column's scale (padding 0)."""
    out_features: int
    fp8: bool = False
    """The codes are float8 e4m3fn bytes (:func:`pack_fp8`), not int8 codes."""

    @property
    def in_features(self) -> int:
        return int(self.codes.shape[1])


def pack_int8(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> PackedInt8:
    """Pack 8-bit codes ``[N, K]`` (uint8) with per-output-channel ``scales`` and ``zeros`` (``[N]`` or ``[N, 1]``:
    one group per channel); ``ValueError`` for another layout (groups, other widths)."""
    n, k = qweight.shape if qweight.dim() == 2 else (-1, -1)
    if qweight.dtype != torch.uint8 or n < 0 or scales.numel() != n or zeros.numel() != n:
        raise ValueError(
            f"pack_int8: needs uint8 codes [N, K] and one scale and zero point per output channel, got codes "
            f"{qweight.dtype} {tuple(qweight.shape)}, scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}"
        )
    rows = -(-n // PACK_BLOCK) * PACK_BLOCK
    padded = torch.zeros((rows, k), dtype=torch.uint8)
    padded[:n] = qweight.detach()
    columns = [torch.zeros(rows, dtype=torch.float32) for _ in range(2)]
    columns[0][:n] = zeros.detach().reshape(n).float()
    columns[1][:n] = scales.detach().reshape(n).float()
    codes = padded.view(-1, PACK_BLOCK, k).transpose(1, 2).contiguous()
    return PackedInt8(codes, columns[0], columns[1], n)


FP8_NAN_CODES = (0x7F, 0xFF)
"""e4m3fn's NaN bytes: the tile decodes them as +-480, so :func:`pack_fp8` refuses a weight holding one."""


def pack_fp8(qweight: torch.Tensor, scales: torch.Tensor) -> PackedInt8:
    """Pack a float8 e4m3fn weight ``[N, K]`` with one fp32 scale per output channel (``[N]`` or ``[N, 1]``) as
    :func:`pack_int8` packs codes; ``ValueError`` for another layout or a NaN byte in the weight."""
    if qweight.dtype != torch.float8_e4m3fn or qweight.dim() != 2 or scales.numel() != qweight.shape[0]:
        raise ValueError(
            f"pack_fp8: needs a float8_e4m3fn [N, K] weight and one scale per output channel, got "
            f"{qweight.dtype} {tuple(qweight.shape)}, scales {tuple(scales.shape)}"
        )
    codes = qweight.detach().view(torch.uint8)
    if any(bool((codes == nan).any()) for nan in FP8_NAN_CODES):
        raise ValueError("pack_fp8: the weight holds a NaN (e4m3fn byte 0x7F or 0xFF)")
    n = int(qweight.shape[0])
    packed = pack_int8(codes, scales.reshape(n, 1), torch.zeros(n, 1, dtype=torch.uint8))
    return dataclasses.replace(packed, fp8=True)


def gemm_packed_int8(
    native: NativeKernels, x: torch.Tensor, w: PackedInt8, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ ((codes - zeros) * scales).T (+ bias)`` (fp8: ``x @ (e4m3(codes) * scales).T (+ bias)``) for fp32
    ``x`` ``[M, K]`` (rows contiguous)."""
    m, k = x.shape
    n = w.out_features
    if (
        x.dtype != torch.float32
        or x.stride(-1) != 1
        or k != w.in_features
        or (bias is not None and (bias.dtype != torch.float32 or bias.numel() < n or not bias.is_contiguous()))
    ):
        raise ValueError(f"gemm_packed_int8: x {tuple(x.shape)} {x.dtype} does not fit a [{n}, {w.in_features}] weight")
    out = torch.empty((m, n), dtype=torch.float32)
    (native.gemm_packed_f8 if w.fp8 else native.gemm_packed_i8)(
        x.data_ptr(), x.stride(0), m, k, w.codes.data_ptr(), w.zeros.data_ptr(), w.scales.data_ptr(), n,
        None if bias is None else bias.data_ptr(), None, 0, out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return out


def dequantized_int8(w: PackedInt8) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight ``(code - zero) * scale`` (fp8: ``e4m3(code) * scale``) the packed codes stand
    for."""
    codes = w.codes.transpose(1, 2).reshape(-1, w.in_features)
    if w.fp8:
        return (codes.view(torch.float8_e4m3fn).float() * w.scales.unsqueeze(1))[: w.out_features]
    codes = codes.float()
    return ((codes - w.zeros.unsqueeze(1)) * w.scales.unsqueeze(1))[: w.out_features]


def gemm_packed_int8_ref(x: torch.Tensor, w: PackedInt8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemm_packed_int8`: the dequantized weight's ``F.linear`` (summed in torch's order)."""
    return torch.nn.functional.linear(x, dequantized_int8(w), bias)


def pack_int8_layer(
    form: LayerForm,
    raw: Mapping[str, torch.Tensor | None],
    projections: Mapping[str, PackedInt8],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> LayerWeights:
    """:meth:`.LayerWeights.pack` of a layer whose ``qkv``, ``o``, ``gate_up`` and ``down`` are all int8 or all fp8
    (``projections``; ``raw`` the norms and biases): the native step dequantizes them in its GEMMs' tiles.
    ``ValueError`` for an MoE form, a projection missing or the two kinds mixed."""
    names = ("qkv", "o", "gate_up", "down")
    if form.experts or set(projections) != set(names):
        raise ValueError(f"pack_int8_layer: int8 {sorted(projections)} of {names}, dense MLPs only")
    if len({projections[name].fp8 for name in names}) != 1:
        raise ValueError("pack_int8_layer: the projections mix int8 and fp8 codes")
    dense = {**raw, **{name: dequantized_int8(projections[name]) for name in names}}
    fp32 = LayerWeights.pack(form, dense, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    columns = tuple(t for name in names for t in (projections[name].zeros, projections[name].scales))
    codes = [projections[name].codes for name in names]
    return dataclasses.replace(
        fp32, qkv=codes[0], o=codes[1], gate_up=codes[2], down=codes[3], int8_columns=columns,
        fp8_codes=projections["qkv"].fp8,
    )  # fmt: skip
