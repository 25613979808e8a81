"""``Fp8Linear``: a drop-in for ``nn.Linear`` whose weight is float8 e4m3 with per-output-channel scales.

The fp8 weight and its scales are buffers (``qweight`` ``[N, K]`` float8_e4m3fn, ``weight_scale``
``[N]`` float32), so ``model.to(device)`` moves them and the runner's weights-bytes sum counts what is
actually resident: 1 byte per weight plus 4 bytes per output channel. The forward is
:func:`tgi_paged_kernels.fp8_gemm.fp8_linear` (Triton dequantize-GEMM on CUDA; on CPU the layer's
weight is dequantized on the fly into the activation dtype, used and freed).
"""

from __future__ import annotations

import torch
from torch import nn

from tgi_paged_backend.runner.quant.fp8 import quantize_fp8_per_channel
from tgi_paged_kernels.fp8_gemm import dequantize_fp8, fp8_linear


class Fp8Linear(nn.Module):
    """``y = x @ (qweight * weight_scale)^T + bias``."""

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight_scale.shape != (qweight.shape[0],):
            raise ValueError(f"weight_scale must be [{qweight.shape[0]}], got {tuple(weight_scale.shape)}")
        self.out_features, self.in_features = int(qweight.shape[0]), int(qweight.shape[1])
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("weight_scale", weight_scale.to(torch.float32).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        """Quantize ``linear``'s weight (per output channel); the bias stays in its dtype."""
        qweight, scale = quantize_fp8_per_channel(linear.weight)
        return cls(qweight.to(linear.weight.device), scale.to(linear.weight.device), linear.bias)

    def output_slice(self, rows: slice) -> "Fp8Linear":
        """Column-parallel shard: output channels ``rows`` (weight rows, their scales and bias)."""
        return Fp8Linear(self.qweight[rows].clone(), self.weight_scale[rows].clone(),
                         None if self.bias is None else self.bias.detach()[rows].clone())

    def input_slice(self, cols: slice) -> "Fp8Linear":
        """Row-parallel shard without bias: input features ``cols``, every output channel's full-row scale
        (a per-output-channel scale multiplies every column, so the ranks' partial sums add up exactly)."""
        return Fp8Linear(self.qweight[:, cols].contiguous(), self.weight_scale.clone(), None)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight a reference ``nn.Linear`` must hold to compute exactly what this module does on CPU."""
        return dequantize_fp8(self.qweight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.qweight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                "fp8_e4m3")
