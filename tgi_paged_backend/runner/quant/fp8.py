"""float8 e4m3 quantization with one scale per output channel (``--quantize fp8`` and test checkpoints).

``scale[n] = max_k |W[n, k]| / 448`` (448 is e4m3fn's largest finite value), ``q = round(W / scale)``
saturated to +-448 in torch's round-to-nearest-even cast, so ``q * scale`` reproduces each row's
largest weight to within e4m3's 3-bit mantissa and no value overflows. An all-zero row gets the
floor scale :data:`MIN_SCALE` and quantizes to zeros.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
MIN_SCALE = float(torch.finfo(torch.float32).tiny)
"""Scale of an all-zero channel (any positive value would do; this one never changes a nonzero row)."""


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` weight -> (``[N, K]`` float8_e4m3fn, ``[N]`` float32 scales)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got {tuple(weight.shape)}")
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (w / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale
