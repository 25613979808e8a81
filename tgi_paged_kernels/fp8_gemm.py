"""Weight-only FP8 linear: ``y = x @ (q * s)^T + b``, float8 e4m3 weights with per-output-channel scales.

``qweight`` is ``[N, K]`` ``torch.float8_e4m3fn`` (the layout of ``nn.Linear.weight`` and of
compressed-tensors checkpoints), ``scale`` is ``[N]`` float32 (one scale per output channel; a
per-tensor scale is broadcast to ``[N]`` by the caller), ``bias`` is ``[N]`` or ``None``.

Three implementations, one contract:

- :func:`fp8_linear_reference`: the specification, in fp32 (dequantize to fp32, then matmul);
- :func:`fp8_linear_torch`: the CPU serving path. It dequantizes *this layer's* weight into the
  activation dtype on the fly (a transient ``N x K`` copy that is freed after the matmul; nothing is
  kept), then calls ``F.linear``. Its arithmetic is exactly that of an ``nn.Linear`` holding the
  dequantized weight, which is what the token-exact tests compare against;
- :func:`_launch_fp8_linear`: the Triton dequantize-GEMM for CUDA tensors. It reads the fp8 bytes,
  decodes them to the activation dtype in registers (exact: every e4m3 value is an fp16 and a bf16
  value), accumulates ``x @ q^T`` in fp32 and applies the scale and bias once per output tile, so the
  dequantized weight never exists in memory.

The decode is done with integer bit operations rather than a hardware fp8 cast, so the kernel runs
on GPUs without fp8 conversion instructions (sm80) and under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._attention_tiles import dot_dtype_and_precision
from ._checks import QUERY_DTYPES, cdiv

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn


def check_fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming the argument unless shapes, dtypes and devices fit."""
    if qweight.dtype != FP8_WEIGHT_DTYPE or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-D {FP8_WEIGHT_DTYPE} tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    if x.dtype not in QUERY_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is invalid: allowed {QUERY_DTYPES}")
    if x.shape[-1] != qweight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} input features, qweight {qweight.shape[1]}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (qweight.shape[0],):
        raise ValueError(f"scale must be float32 [{qweight.shape[0]}], got {scale.dtype} {tuple(scale.shape)}")
    if bias is not None and tuple(bias.shape) != (qweight.shape[0],):
        raise ValueError(f"bias must be [{qweight.shape[0]}], got {tuple(bias.shape)}")
    devices = {t.device for t in (x, qweight, scale, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"x, qweight, scale and bias must be on one device, got {sorted(map(str, devices))}")


def dequantize_fp8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * s`` per output channel, computed in fp32 and rounded once to ``dtype``."""
    return (qweight.to(torch.float32) * scale.to(torch.float32).unsqueeze(1)).to(dtype)


def fp8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The specification: everything in fp32, result in fp32."""
    check_fp8_linear(x, qweight, scale, bias)
    return F.linear(x.float(), dequantize_fp8(qweight, scale, torch.float32), None if bias is None else bias.float())


def fp8_linear_torch(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """CPU path: dequantize this layer's weight to ``x.dtype`` (transient), then ``F.linear``."""
    check_fp8_linear(x, qweight, scale, bias)
    return F.linear(x, dequantize_fp8(qweight, scale, x.dtype), bias)


@triton.jit
def _decode_e4m3(bits):
    # float8 e4m3fn bits (int32 in [0, 255]) -> fp32, exactly: sign 1, exponent 4 (bias 7), mantissa 3,
    # no infinities, 0x7F/0xFF are NaN.
    sign = (bits >> 7) << 31
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    normal = (sign | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)  # 120 = 127 - 7
    subnormal = mantissa.to(tl.float32) * 0.001953125  # m * 2^-9
    subnormal = tl.where(sign != 0, -subnormal, subnormal)
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((exponent == 15) & (mantissa == 7), float("nan"), value)


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    stride_xm,
    stride_xk,  #
    w_ptr,
    stride_wn,
    stride_wk,  #
    scale_ptr,
    bias_ptr,  #
    y_ptr,
    stride_ym,
    stride_yn,  #
    M,
    N,
    K,  #
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  #
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  #
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        # [BLOCK_K, BLOCK_N] tile of q^T; padding bytes are 0 = +0.0
        bits = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + kk[:, None] * stride_wk,
            mask=mask_n[None, :] & mask_k[:, None],
            other=0,
        )
        w = _decode_e4m3(bits.to(tl.int32)).to(DOT_DTYPE)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _launch_fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton dequantize-GEMM; ``x`` is ``[..., K]``, the result ``[..., N]`` in ``x.dtype``."""
    check_fp8_linear(x, qweight, scale, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M, K = x2.shape
    N = qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    block_m = 16 if M <= 16 else 64  # decode batches are a few rows: do not pad them to 64
    block_n, block_k = 64, 64
    w_bits = qweight.view(torch.uint8)
    dot_dtype, dot_precision = dot_dtype_and_precision(x, FP8_WEIGHT_DTYPE)  # the activation dtype (fp32 for
    # bf16 under the interpreter, whose tl.dot cannot multiply bf16)
    grid = (cdiv(M, block_m), cdiv(N, block_n))
    _fp8_linear_kernel[grid](
        x2,
        x2.stride(0),
        x2.stride(1),
        w_bits,
        w_bits.stride(0),
        w_bits.stride(1),
        scale,
        bias if bias is not None else scale,
        y,
        y.stride(0),
        y.stride(1),
        M,
        N,
        K,
        HAS_BIAS=bias is not None,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y.reshape(*lead, N)


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ (q * s)^T + b``: Triton on CUDA tensors, :func:`fp8_linear_torch` anywhere else."""
    if x.device.type == "cuda":
        return _launch_fp8_linear(x, qweight, scale, bias)
    return fp8_linear_torch(x, qweight, scale, bias)
