"""Weight-only int4/int8 linear: ``y = x @ W^T + b`` with ``W[n, k] = (code - zero) * scale`` per group.

One resident layout serves GPTQ, AWQ and compressed-tensors ``pack-quantized`` checkpoints (each
loader repacks its file's codes into it, exactly):

- ``qweight``: uint8. ``bits=4``: ``[N, K/2]``, two codes per byte along the input dim, input column
  ``2j`` in the low nibble and ``2j+1`` in the high one; ``bits=8``: ``[N, K]``, one code per byte.
  Codes are unsigned, ``0 .. 2^bits - 1``;
- ``scales``: float32 ``[N, G]``, one per output channel and group;
- ``zeros``: uint8 ``[N, G]``, the code that means 0.0 (``2^(bits-1)`` for symmetric formats);
- ``g_idx``: int32 ``[K]``, the group of each input column (``k // group_size``, or GPTQ's act-order
  permutation: any map into ``0 .. G-1``).

Three implementations, one contract (as :mod:`.fp8_gemm`):

- :func:`int_linear_reference`: the specification in fp32 (dequantize, then matmul);
- :func:`int_linear_torch`: the CPU serving path: dequantizes *this layer's* weight into the
  activation dtype (``(code - zero)`` times the scale in fp32, rounded once; a transient copy freed
  after the matmul), then ``F.linear``: exactly an ``nn.Linear`` holding the dequantized weight;
- :func:`_launch_int_linear`: the Triton dequantize-GEMM for CUDA tensors: it reads the packed bytes,
  unpacks and dequantizes one ``BLOCK_K x BLOCK_N`` tile in registers (the same fp32 arithmetic,
  rounded once to the activation dtype), and accumulates ``x @ W^T`` in fp32; the dequantized weight
  never exists in memory. Unlike fp8 codes, ``(code - zero) * scale`` is not exact in fp16/bf16, so
  the contract for those dtypes is the weight rounded to the activation dtype (what the CPU path and
  an ``nn.Linear`` holding the dequantized weight use); the tests compare with exactly that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._attention_tiles import _TL_DTYPES, dot_dtype_and_precision
from ._checks import QUERY_DTYPES, cdiv

INT_BITS = (4, 8)


def packed_columns(in_features: int, bits: int) -> int:
    """Bytes per output row of ``qweight``."""
    return in_features // 2 if bits == 4 else in_features


def check_int_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None,
    bits: int,
) -> None:
    """Raise ``ValueError`` naming the argument unless shapes, dtypes and devices fit."""
    if bits not in INT_BITS:
        raise ValueError(f"bits={bits} is invalid: allowed {INT_BITS}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-D uint8 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    if g_idx.dtype != torch.int32 or g_idx.dim() != 1:
        raise ValueError(f"g_idx must be a 1-D int32 tensor, got {g_idx.dtype} {tuple(g_idx.shape)}")
    n, k = qweight.shape[0], g_idx.shape[0]
    if qweight.shape[1] != packed_columns(k, bits) or (bits == 4 and k % 2):
        raise ValueError(f"qweight {tuple(qweight.shape)} does not hold {k} {bits}-bit input columns")
    if x.dtype not in QUERY_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is invalid: allowed {QUERY_DTYPES}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    if scales.dtype != torch.float32 or scales.dim() != 2 or scales.shape[0] != n:
        raise ValueError(f"scales must be float32 [{n}, groups], got {scales.dtype} {tuple(scales.shape)}")
    if zeros.dtype != torch.uint8 or zeros.shape != scales.shape:
        raise ValueError(f"zeros must be uint8 {tuple(scales.shape)}, got {zeros.dtype} {tuple(zeros.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    devices = {t.device for t in (x, qweight, scales, zeros, g_idx, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(
            f"x, qweight, scales, zeros, g_idx and bias must be on one device, got {sorted(map(str, devices))}"
        )


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """``[N, K]`` uint8 codes of ``qweight``."""
    if bits == 8:
        return qweight
    return torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_codes`: ``[N, K]`` codes in ``0 .. 2^bits - 1`` -> ``qweight``."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def _contiguous_groups(g_idx: torch.Tensor, groups: int) -> bool:
    """``g_idx`` is ``k // (K / groups)``: each group is one run of consecutive input columns."""
    k = g_idx.shape[0]
    if k % groups:
        return False
    expected = torch.arange(k, dtype=torch.int32, device=g_idx.device) // (k // groups)
    return bool(torch.equal(g_idx, expected))


def dequantize_int(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """``(code - zero) * scale`` of every weight's group, in fp32, rounded once to ``dtype``.

    Codes and zeros are small integers, so ``code - zero`` is exact in fp32 and the product is the one
    rounding. Written for CPU speed (it runs for every linear of every step): the codes go straight
    into one fp32 buffer that is shifted and scaled in place, by broadcasting when each group is a run
    of columns (gathering per column for act-order)."""
    n, k = qweight.shape[0], g_idx.shape[0]
    if bits == 4:
        weight = torch.empty(n, k // 2, 2, dtype=torch.float32, device=qweight.device)
        weight[..., 0] = qweight & 0xF
        weight[..., 1] = qweight >> 4
        weight = weight.view(n, k)
    else:
        weight = qweight.to(torch.float32)
    groups = scales.shape[1]
    if _contiguous_groups(g_idx, groups):
        runs = weight.view(n, groups, k // groups)
        runs.sub_(zeros.unsqueeze(2)).mul_(scales.unsqueeze(2))
    else:
        group = g_idx.long()
        weight.sub_(zeros[:, group]).mul_(scales[:, group])
    return weight.to(dtype)


def int_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The specification: everything in fp32, result in fp32."""
    check_int_linear(x, qweight, scales, zeros, g_idx, bias, bits)
    weight = dequantize_int(qweight, scales, zeros, g_idx, bits, torch.float32)
    return F.linear(x.float(), weight, None if bias is None else bias.float())


def int_linear_torch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU path: dequantize this layer's weight to ``x.dtype`` (transient), then ``F.linear``."""
    check_int_linear(x, qweight, scales, zeros, g_idx, bias, bits)
    return F.linear(x, dequantize_int(qweight, scales, zeros, g_idx, bits, x.dtype), bias)


@triton.jit
def _round_to(w, W_DTYPE: tl.constexpr):
    # fp32 -> W_DTYPE rounded to nearest even, returned as a W_DTYPE-representable fp32. bf16 by bit
    # arithmetic: the interpreter's fp32 -> bf16 cast truncates, a GPU's rounds; this is the same on both.
    if W_DTYPE == tl.bfloat16:
        bits = w.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return w.to(W_DTYPE).to(tl.float32)


@triton.jit
def _int_linear_kernel(
    x_ptr,
    stride_xm,
    stride_xk,  #
    w_ptr,
    stride_wn,
    stride_wk,  #
    s_ptr,
    z_ptr,
    stride_sn,
    stride_sg,  #
    g_ptr,
    bias_ptr,  #
    y_ptr,
    stride_ym,
    stride_yn,  #
    M,
    N,
    K,  #
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  #
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
        mask_w = mask_n[None, :] & mask_k[:, None]
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + kk[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        row = offs_n[None, :].to(tl.int64)
        if BITS == 4:  # [BLOCK_K, BLOCK_N] tile of W^T: byte k // 2, nibble k % 2
            packed = tl.load(w_ptr + row * stride_wn + (kk // 2)[:, None] * stride_wk, mask=mask_w, other=0)
            code = (packed.to(tl.int32) >> ((kk % 2) * 4)[:, None]) & 0xF
        else:
            code = tl.load(w_ptr + row * stride_wn + kk[:, None] * stride_wk, mask=mask_w, other=0).to(tl.int32)
        group = tl.load(g_ptr + kk, mask=mask_k, other=0)
        where = row * stride_sn + group[:, None].to(tl.int64) * stride_sg
        zero = tl.load(z_ptr + where, mask=mask_w, other=0).to(tl.int32)
        scale = tl.load(s_ptr + where, mask=mask_w, other=0.0)
        # fp32 product rounded once to the activation dtype, as the CPU path; padding: (0 - 0) * 0 = 0
        w = _round_to((code - zero).to(tl.float32) * scale, W_DTYPE).to(DOT_DTYPE)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn,
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _launch_int_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton dequantize-GEMM; ``x`` is ``[..., K]``, the result ``[..., N]`` in ``x.dtype``."""
    check_int_linear(x, qweight, scales, zeros, g_idx, bias, bits)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M, K = x2.shape
    N = qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    block_m = 16 if M <= 16 else 64  # decode batches are a few rows: do not pad them to 64
    block_n, block_k = 64, 64
    # The dequantized tile is computed in fp32 and rounded once to the activation dtype; the dot runs in
    # that dtype (fp32 for bf16 under the interpreter, whose tl.dot cannot multiply bf16).
    dot_dtype, dot_precision = dot_dtype_and_precision(x, x.dtype)
    grid = (cdiv(M, block_m), cdiv(N, block_n))
    _int_linear_kernel[grid](
        x2,
        x2.stride(0),
        x2.stride(1),
        qweight,
        qweight.stride(0),
        qweight.stride(1),
        scales,
        zeros,
        scales.stride(0),
        scales.stride(1),
        g_idx,
        bias if bias is not None else scales,
        y,
        y.stride(0),
        y.stride(1),
        M,
        N,
        K,
        BITS=bits,
        HAS_BIAS=bias is not None,
        W_DTYPE=_TL_DTYPES[x.dtype],
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return y.reshape(*lead, N)


def int_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T + b`` over int codes: Triton on CUDA tensors, :func:`int_linear_torch` anywhere else."""
    if x.device.type == "cuda":
        return _launch_int_linear(x, qweight, scales, zeros, g_idx, bits, bias)
    return int_linear_torch(x, qweight, scales, zeros, g_idx, bits, bias)
