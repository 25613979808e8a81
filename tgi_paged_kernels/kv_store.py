"""Store the K/V of new tokens into their slots of the paged pool.

Token ``i`` goes to slot ``slot_mapping[i]``: block ``slot // block_size``, offset
``slot % block_size``; a negative slot (padding) is skipped. fp8 caches store ``x / scale``
saturated to the format's finite range, so an outlier becomes the largest finite value, never
inf/NaN (e5m2 would otherwise overflow to inf).

One program stores one token for ``BLOCK_H`` heads: each head's row is a contiguous
``head_dim`` run in both source and cache, so loads and stores are coalesced. V may be narrower than K
(``v_head_dim``, masked within K's padded width) or absent (a latent cache: the key is the whole entry).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_store, check_unit_inner_stride, is_fp8, next_power_of_2

MAX_ELEMENTS_PER_PROGRAM = 4096  # heads x padded head_dim per program: 16 KiB of fp32 registers for K and V each

# fp8 formats as (mantissa bits, exponent of the smallest normal): the grid _round_to_fp8_grid rounds to.
FP8_GRIDS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


@triton.jit
def _round_to_fp8_grid(y, MANTISSA_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    # Round fp32 y (already within the fp8 range) to the nearest fp8 value, ties to even, in fp32
    # arithmetic, so the cast that follows is exact on every backend. (The Triton interpreter's
    # fp8 cast rounds half up and drops the carry into the exponent: -1.97 -> -1.0.)
    bits = y.to(tl.int32, bitcast=True)
    # The ulp of |y| in fp8: 2^(exponent - MANTISSA_BITS), fixed below the normal range (subnormals).
    exponent = ((bits >> 23) & 0xFF) - 127  # fp32: 8 exponent bits above 23 mantissa bits, bias 127
    ulp_exponent = tl.maximum(exponent, MIN_NORMAL_EXP) - MANTISSA_BITS
    ulp = ((ulp_exponent + 127) << 23).to(tl.float32, bitcast=True)  # 2^ulp_exponent, built from its bits
    # Adding 1.5 * 2^23 ulps moves |y| to where fp32's own spacing is one fp8 ulp, so the fp32 add
    # rounds it to a multiple of ulp (ties to even); subtracting the constant back is exact.
    magic = ulp * 12582912.0  # 1.5 * 2^23
    rounded = (tl.abs(y) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded)  # sign from the sign bit, so -tiny -> -0.0 as a cast gives


@triton.jit
def _store_kv_kernel(
    key_ptr,
    stride_kt,
    stride_kh,
    stride_kd,  #
    value_ptr,
    stride_vt,
    stride_vh,
    stride_vd,  #
    k_cache_ptr,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,  #
    v_cache_ptr,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,  #
    slot_mapping_ptr,  #
    k_scale,
    v_scale,
    fp8_max,  #
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,  #
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  #
    HAS_VALUE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,  #
    FP8_MANTISSA_BITS: tl.constexpr,
    FP8_MIN_NORMAL_EXP: tl.constexpr,  #
):
    token = tl.program_id(0)
    head_block = tl.program_id(1)

    # -- where this token goes ----------------------------------------------------------------------
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token: nothing to store
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    # -- [BLOCK_H, HEAD_DIM_PAD] tile of this token's heads ------------------------------------------
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)

    # -- quantize: fp8 stores x / scale, saturated, rounded to nearest even ---------------------------
    # div_rn is IEEE division, as torch's x / scale; Triton's `/` is the approximate div.full.f32.
    if IS_FP8:
        k = tl.minimum(tl.maximum(tl.div_rn(k.to(tl.float32), k_scale), -fp8_max), fp8_max)
        k = _round_to_fp8_grid(k, FP8_MANTISSA_BITS, FP8_MIN_NORMAL_EXP)
    kc_offs = block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    tl.store(k_cache_ptr + kc_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    # -- the same for V, V_HEAD_DIM <= HEAD_DIM wide (none for a latent cache) -------------------------
    if HAS_VALUE:
        v_mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < V_HEAD_DIM)[None, :]
        v_src = value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
        v = tl.load(v_src, mask=v_mask)
        if IS_FP8:
            v = tl.minimum(tl.maximum(tl.div_rn(v.to(tl.float32), v_scale), -fp8_max), fp8_max)
            v = _round_to_fp8_grid(v, FP8_MANTISSA_BITS, FP8_MIN_NORMAL_EXP)
        vc_offs = block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
        tl.store(v_cache_ptr + vc_offs, v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def _launch_store_kv(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Check arguments and launch ``_store_kv_kernel``, whatever the device.

    Parameters
    ----------
    key, value : [num_tokens, num_kv_heads, head_dim] (value: v_head_dim <= head_dim), fp16/bf16/fp32, head_dim
        contiguous; ``value`` ``None`` with ``v_cache`` ``None``: the key only (a latent cache)
    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim] (V: v_head_dim), any cache dtype, head_dim
        contiguous (other strides free); written in place
    slot_mapping : int64/int32 [num_tokens]; negative = skip
    k_scale, v_scale : fp8 scales (ignored for other cache dtypes)
    """
    cache = check_store(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    has_value = value is not None and v_cache is not None
    # key only: the V arguments are placeholders the kernel never reads
    value_src = value if value is not None else key
    value_pool = v_cache if v_cache is not None else k_cache
    check_unit_inner_stride(key=key, value=value_src, k_cache=k_cache, v_cache=value_pool)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return

    dim_pad = next_power_of_2(cache.head_dim)
    block_h = min(next_power_of_2(cache.num_kv_heads), max(1, MAX_ELEMENTS_PER_PROGRAM // dim_pad))
    fp8 = is_fp8(k_cache.dtype)
    mantissa_bits, min_normal_exp = FP8_GRIDS.get(k_cache.dtype, (0, 0))
    grid = (num_tokens, triton.cdiv(cache.num_kv_heads, block_h))
    _store_kv_kernel[grid](
        key, *key.stride(),  #
        value_src, *value_src.stride(),  #
        k_cache, *k_cache.stride(),  #
        value_pool, *value_pool.stride(),  #
        slot_mapping,  #
        float(k_scale), float(v_scale), torch.finfo(k_cache.dtype).max if fp8 else 0.0,  #
        NUM_KV_HEADS=cache.num_kv_heads, BLOCK_H=block_h,  #
        HEAD_DIM=cache.head_dim, V_HEAD_DIM=cache.v_head_dim, HEAD_DIM_PAD=dim_pad, HAS_VALUE=has_value,  #
        BLOCK_SIZE=cache.block_size, IS_FP8=fp8,  #
        FP8_MANTISSA_BITS=mantissa_bits, FP8_MIN_NORMAL_EXP=min_normal_exp,  #
    )  # fmt: skip
