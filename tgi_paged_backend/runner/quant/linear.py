"""Drop-ins for ``nn.Linear``: ``Fp8Linear`` (float8 e4m3 weights, per-output-channel scales) and
``IntLinear`` (int4/int8 codes with per-group scales and zero points: GPTQ, AWQ, compressed-tensors).

The fp8 weight and its scales are buffers (``qweight`` ``[N, K]`` float8_e4m3fn, ``weight_scale``
``[N]`` float32), so ``model.to(device)`` moves them and the runner's weights-bytes sum counts what is
actually resident: 1 byte per weight plus 4 bytes per output channel. The forward is
:func:`tgi_paged_kernels.fp8_gemm.fp8_linear` (Triton dequantize-GEMM on CUDA; on CPU the layer's
weight is dequantized on the fly into the activation dtype, used and freed).

``IntLinear`` holds the layout of :mod:`tgi_paged_kernels.int_gemm`: uint8 codes (two per byte for
int4: ``N * K / 2`` bytes), float32 ``scales`` and uint8 ``zeros`` ``[N, G]`` (5 bytes per group of
each output channel) and int32 ``g_idx`` ``[K]`` (4 bytes per input column).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tgi_paged_backend.runner.quant.fp8 import quantize_fp8_per_channel
from tgi_paged_backend.runner.quant.int_codes import IntCodes
from tgi_paged_kernels import (
    check_int_linear,
    dequantize_fp8,
    dequantize_int,
    fp8_linear,
    int_linear,
    pack_codes,
    unpack_codes,
)


class Fp8Linear(nn.Module):
    """``y = x @ (qweight * weight_scale)^T + bias``."""

    # Buffers (register_buffer) and the optional bias, declared for the type checker: nn.Module's
    # __getattr__ types them as ``Tensor | Module``.
    qweight: torch.Tensor
    weight_scale: torch.Tensor
    bias: nn.Parameter | None

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight_scale.shape != (qweight.shape[0],):
            raise ValueError(f"weight_scale must be [{qweight.shape[0]}], got {tuple(weight_scale.shape)}")
        self.out_features, self.in_features = int(qweight.shape[0]), int(qweight.shape[1])
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("weight_scale", weight_scale.to(torch.float32).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """Quantize ``linear``'s weight (per output channel); the bias stays in its dtype."""
        qweight, scale = quantize_fp8_per_channel(linear.weight)
        return cls(qweight.to(linear.weight.device), scale.to(linear.weight.device), linear.bias)

    def output_slice(self, rows: slice) -> Fp8Linear:
        """Column-parallel shard: output channels ``rows`` (weight rows, their scales and bias)."""
        return self.output_rows([rows])

    def output_rows(self, rows: Sequence[slice]) -> Fp8Linear:
        """The output channels of every run in ``rows``, side by side (a rank's share of each part of a fused
        projection)."""
        index = _row_index(rows, self.out_features, self.qweight.device)
        return Fp8Linear(
            self.qweight[index],
            self.weight_scale[index],
            None if self.bias is None else self.bias.detach()[index],
        )

    def input_slice(self, cols: slice) -> Fp8Linear:
        """Row-parallel shard without bias: input features ``cols``, every output channel's full-row scale
        (a per-output-channel scale multiplies every column, so the ranks' partial sums add up exactly)."""
        return Fp8Linear(self.qweight[:, cols].contiguous(), self.weight_scale.clone(), None)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight a reference ``nn.Linear`` must hold to compute exactly what this module does on CPU."""
        return dequantize_fp8(self.qweight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.qweight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8_e4m3"
        )


class IntLinear(nn.Module):
    """``y = x @ W^T + bias`` with ``W[n, k] = (code[n, k] - zeros[n, g]) * scales[n, g]``, ``g = g_idx[k]``."""

    # Buffers (register_buffer) and the optional bias, declared for the type checker (see Fp8Linear).
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bias: nn.Parameter | None

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        g_idx: torch.Tensor,
        bits: int,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.bits = int(bits)
        self.out_features, self.in_features = int(qweight.shape[0]), int(g_idx.shape[0])
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(torch.float32).contiguous())
        self.register_buffer("zeros", zeros.contiguous())
        self.register_buffer("g_idx", g_idx.to(torch.int32).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        probe = torch.empty(0, self.in_features, dtype=torch.float32, device=qweight.device)
        check_int_linear(probe, self.qweight, self.scales, self.zeros, self.g_idx, self.bias, self.bits)

    @classmethod
    def from_codes(cls, codes: IntCodes, bias: torch.Tensor | None) -> IntLinear:
        """Pack decoded codes (:mod:`.int_codes`) into the resident layout; the bias stays in its dtype."""
        return cls(pack_codes(codes.codes, codes.bits), codes.scales, codes.zeros, codes.g_idx, codes.bits, bias)

    def codes(self) -> torch.Tensor:
        """``[N, K]`` uint8 codes, unpacked."""
        return unpack_codes(self.qweight, self.bits)

    def output_slice(self, rows: slice) -> IntLinear:
        """Column-parallel shard: output channels ``rows`` (their codes, scales, zeros and bias)."""
        return self.output_rows([rows])

    def output_rows(self, rows: Sequence[slice]) -> IntLinear:
        """The output channels of every run in ``rows``, side by side (codes pack along the inputs, so whole
        rows move with their scales and zeros)."""
        index = _row_index(rows, self.out_features, self.qweight.device)
        return IntLinear(
            self.qweight[index],
            self.scales[index],
            self.zeros[index],
            self.g_idx.clone(),
            self.bits,
            None if self.bias is None else self.bias.detach()[index],
        )

    def input_slice(self, cols: slice) -> IntLinear:
        """Row-parallel shard without bias: input features ``cols`` with their ``g_idx``, and the groups
        those columns use (``g_idx`` rebased on the first one kept). With ``k // group_size`` groups and
        a slice on group boundaries each rank keeps only its own groups; with act-order every group a
        column of the slice belongs to is kept, so any ``g_idx`` is served exactly."""
        start, stop, _ = cols.indices(self.in_features)
        if self.bits == 4 and (start % 2 or stop % 2):
            raise ValueError(f"int4 input slice [{start}, {stop}) must start and end on an even column")
        g_idx = self.g_idx[start:stop]
        lo, hi = int(g_idx.min()), int(g_idx.max()) + 1
        per_byte = 2 if self.bits == 4 else 1
        return IntLinear(
            self.qweight[:, start // per_byte : stop // per_byte].contiguous(),
            self.scales[:, lo:hi].contiguous(),
            self.zeros[:, lo:hi].contiguous(),
            (g_idx - lo).contiguous(),
            self.bits,
            None,
        )

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight a reference ``nn.Linear`` must hold to compute exactly what this module does on CPU."""
        return dequantize_int(self.qweight, self.scales, self.zeros, self.g_idx, self.bits, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int_linear(x, self.qweight, self.scales, self.zeros, self.g_idx, self.bits, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int{self.bits}, groups={self.scales.shape[1]}"
        )


def stacked_int_linear(parts: Sequence[IntLinear]) -> IntLinear:
    """One :class:`IntLinear` whose output is the outputs of ``parts`` side by side (the same bits and ``g_idx``;
    all with a bias or none): their codes, scales and zeros stacked by output channel (q/k/v or gate/up in one
    GEMM)."""
    first = parts[0]
    if any(p.bits != first.bits or not torch.equal(p.g_idx, first.g_idx) for p in parts) or (
        len({p.bias is None for p in parts}) != 1
    ):
        raise ValueError("stacked_int_linear: parts of other bits, groups or biases")
    biases = [p.bias.detach() for p in parts if p.bias is not None]
    return IntLinear(
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]),
        first.g_idx.clone(),
        first.bits,
        torch.cat(biases) if biases else None,
    )


def stacked_fp8_linear(parts: Sequence[Fp8Linear]) -> Fp8Linear:
    """One :class:`Fp8Linear` whose output is the outputs of ``parts`` side by side (all with a bias or none): their
    fp8 weights and per-channel scales stacked by output channel (q/k/v or gate/up in one GEMM)."""
    if len({p.bias is None for p in parts}) != 1 or len({p.qweight.dtype for p in parts}) != 1:
        raise ValueError("stacked_fp8_linear: parts of other fp8 formats or biases")
    biases = [p.bias.detach() for p in parts if p.bias is not None]
    return Fp8Linear(
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.weight_scale for p in parts]),
        torch.cat(biases) if biases else None,
    )


def _row_index(rows: Sequence[slice], out_features: int, device: torch.device) -> torch.Tensor:
    """The output channels of ``rows`` in order, as an index (advanced indexing copies)."""
    runs = [range(*r.indices(out_features)) for r in rows]
    return torch.tensor([i for run in runs for i in run], dtype=torch.long, device=device)


QUANTIZED_LINEARS = (Fp8Linear, IntLinear)
"""Module types that replace ``nn.Linear`` under ``--quantize`` (all support output/input slicing)."""

QuantizedLinear = Fp8Linear | IntLinear
"""Any of :data:`QUANTIZED_LINEARS`, as a type."""
