"""The inner loop shared by the paged decode and prefill kernels: online softmax over key tiles
read through a block table.

A program owns ``BLOCK_M`` query *rows*. A row is one (query token, query head) pair; all rows of a
program share one KV head, so each K/V tile loaded from the pool serves every query head of the
GQA group (decode packs the group's heads as rows; prefill packs tokens x heads). Each row carries
its own token position, which gives causal and sliding-window masking per row.

Keys are visited in tiles of ``BLOCK_N`` token positions. Every position is located on its own,
``block_tables[pos // BLOCK_SIZE]`` and offset ``pos % BLOCK_SIZE``, so a tile may span several
physical blocks (block size 8 with BLOCK_N 64) or part of one (block size 32 with BLOCK_N 16).

Keys may be wider than values (multi-head latent attention: K is a ``Dk = 576``-wide latent entry, V its
first ``Dv = 512`` columns, often the strided view ``k_cache[..., :Dv]``). Triton blocks are powers of
two, so K's columns are then split in two padded parts, ``[0, HEAD_DIM_PAD)`` (the width V pads to) and a
tail ``[HEAD_DIM_PAD, HEAD_DIM_PAD + K_TAIL_PAD)``, and scores are the sum of two dots: 512 + 64 for
DeepSeek's 576 instead of one 1024-wide tile. V and the output are ``V_HEAD_DIM`` wide, padded to
``V_HEAD_DIM_PAD``; V has strides of its own. Equal widths have no tail (``HAS_K_TAIL`` false).

The softmax is the streaming form of FlashAttention-2 (Dao, 2023, arXiv:2307.08691, Algorithm 1):
running row maximum ``m_i``, running denominator ``l_i``, unnormalised output ``acc``; the exponent
is taken base 2 with the scores pre-multiplied by log2(e), which is exact algebra and maps to the
hardware ``ex2`` instruction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._checks import is_fp8, next_power_of_2

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) == exp2(x * LOG2E)

# Initial running maximum. Finite on purpose: a row whose keys so far are all masked (-inf) then
# gets alpha = exp2(M_FLOOR - M_FLOOR) = 1 and p = exp2(-inf) = 0, where an initial -inf would give
# (-inf) - (-inf) = NaN. Real scores (|s| << 1e30) replace it at the first visible key.
M_FLOOR: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1), an exact identity. |x| is clamped to 10 first: tanh(10) is
    # 1 - 4e-9, which rounds to 1.0 in fp32, and the clamp keeps exp() from overflowing.
    x = tl.minimum(tl.maximum(x, -10.0), 10.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _load_query_rows(
    query_ptr,
    row_offs,  # [BLOCK_M] element offset of each row's query vector
    row_mask,  # [BLOCK_M]
    stride_qd,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    K_TAIL_PAD: tl.constexpr,
    HAS_K_TAIL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    # The query rows split as K's columns: [BLOCK_M, HEAD_DIM_PAD] and [BLOCK_M, K_TAIL_PAD] (zeros without
    # a tail), in DOT_DTYPE, padding columns zero.
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_offs = row_offs[:, None] + offs_d[None, :] * stride_qd
    q = tl.load(query_ptr + q_offs, mask=row_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    q_tail = tl.zeros((BLOCK_M, K_TAIL_PAD), dtype=DOT_DTYPE)
    if HAS_K_TAIL:
        offs_t = HEAD_DIM_PAD + tl.arange(0, K_TAIL_PAD)
        t_offs = row_offs[:, None] + offs_t[None, :] * stride_qd
        q_tail = tl.load(query_ptr + t_offs, mask=row_mask[:, None] & (offs_t < HEAD_DIM)[None, :], other=0.0)
        q_tail = q_tail.to(DOT_DTYPE)
    return q.to(DOT_DTYPE), q_tail


@triton.jit
def _attend_kv_tiles(
    q,
    q_tail,  # [BLOCK_M, HEAD_DIM_PAD], [BLOCK_M, K_TAIL_PAD] in DOT_DTYPE (see _load_query_rows)
    q_pos,  # [BLOCK_M] int32 token position of each row
    q_reach,  # [BLOCK_M] int32 last key position each row sees (q_pos, or a bidirectional span's end)
    kv_lo,
    kv_hi,  # visit key positions kv_lo <= p < kv_hi (all < seq_len)
    block_table_ptr,  # this request's row of the block table
    k_head_ptr,
    stride_kb,
    stride_ks,
    stride_kd,  # K pool, already offset to this KV head
    v_head_ptr,
    stride_vb,
    stride_vs,
    stride_vd,  # V pool, already offset to this KV head
    sm_scale,
    softcap,
    sliding_window,  # sm_scale includes k_scale
    alibi_slope,  # [BLOCK_M] fp32 ALiBi slope of each row's query head (USE_ALIBI)
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  #
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # K's width, or with HAS_K_TAIL its first part's
    K_TAIL_PAD: tl.constexpr,
    HAS_K_TAIL: tl.constexpr,  # K's columns [HEAD_DIM_PAD, HEAD_DIM) as a second dot
    V_HEAD_DIM: tl.constexpr,
    V_HEAD_DIM_PAD: tl.constexpr,  #
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,  #
    USE_ALIBI: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  #
):
    # Returns the softmax state after the range: unnormalised output acc [BLOCK_M, V_HEAD_DIM_PAD],
    # row maximum m_i and denominator l_i [BLOCK_M], all fp32, scores in log2 units.
    acc = tl.zeros((BLOCK_M, V_HEAD_DIM_PAD), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), M_FLOOR, tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM  # head dims 80, 96 are padded to 128
    offs_t = HEAD_DIM_PAD + tl.arange(0, K_TAIL_PAD)
    offs_v = tl.arange(0, V_HEAD_DIM_PAD)
    v_mask = offs_v < V_HEAD_DIM
    for tile_start in range(kv_lo, kv_hi, BLOCK_N):
        # -- locate the tile's token positions in the pool -------------------------------------
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_hi  # never read past seq_len: those slots may hold NaN
        physical_block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot_in_block = offs_n % BLOCK_SIZE
        # -- scores = q @ k^T, K loaded transposed: [HEAD_DIM_PAD, BLOCK_N] -----------------------
        k_offs = (physical_block * stride_kb + slot_in_block * stride_ks)[None, :] + offs_d[:, None] * stride_kd
        k = tl.load(k_head_ptr + k_offs, mask=d_mask[:, None] & n_mask[None, :], other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
        if HAS_K_TAIL:  # the rest of K's columns: [K_TAIL_PAD, BLOCK_N]
            t_offs = (physical_block * stride_kb + slot_in_block * stride_ks)[None, :] + offs_t[:, None] * stride_kd
            t_mask = (offs_t < HEAD_DIM)[:, None] & n_mask[None, :]
            k_tail = tl.load(k_head_ptr + t_offs, mask=t_mask, other=0.0).to(DOT_DTYPE)
            s += tl.dot(q_tail, k_tail, input_precision=DOT_PRECISION)
        s = s * sm_scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        if USE_ALIBI:  # ALiBi: slope * (key position - query position), after scaling and capping
            s = s + alibi_slope[:, None] * (offs_n[None, :] - q_pos[:, None]).to(tl.float32)

        # -- mask: inside the range, up to each row's reach (causal: itself), inside the window ---
        visible = n_mask[None, :] & (offs_n[None, :] <= q_reach[:, None])
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s * LOG2E, float("-inf"))

        # -- update m_i and l_i, rescale acc ------------------------------------------------------
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        # -- acc += p @ v, V loaded as [BLOCK_N, V_HEAD_DIM_PAD] ----------------------------------
        v_offs = (physical_block * stride_vb + slot_in_block * stride_vs)[:, None] + offs_v[None, :] * stride_vd
        v = tl.load(v_head_ptr + v_offs, mask=n_mask[:, None] & v_mask[None, :], other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _add_sink(acc, m_i, l_i, sink):
    # Attention sinks (gpt-oss): one more score per row, ``sink`` [BLOCK_M] fp32 in natural-log units,
    # with no value row: it joins the denominator only. Same rescaling as a key tile of one column.
    # An empty key range (m_i == M_FLOOR) gives alpha = 0, l_i = 1, acc = 0: zeros, as the reference.
    s = sink * LOG2E
    m_new = tl.maximum(m_i, s)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], m_new, l_i * alpha + tl.exp2(s - m_new)


# ---------------------------------------------------------------------------------------------
# Launcher-side helpers
# ---------------------------------------------------------------------------------------------

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtype_and_precision(query: torch.Tensor, cache_dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The dtype q, K/V tiles and probabilities are cast to for ``tl.dot``, and the dot's precision.

    The query's dtype when the cache holds the same dtype or fp8 (fp8 values are exact in fp16 and
    bf16); fp32 when they differ otherwise (fp16 <-> bf16 casts lose range or precision). fp32 uses
    "ieee": TF32's 10-bit mantissa would cost an fp32 model ~1e-3 relative error. CPU tensors can
    only mean the Triton interpreter, whose ``tl.dot`` multiplies bf16 bit patterns as integers
    (triton-lang/triton#11584, "not supported yet"), so bf16 is computed in fp32 there.
    """
    interpreted_bf16 = query.dtype == torch.bfloat16 and query.device.type == "cpu"
    if interpreted_bf16 or not (cache_dtype == query.dtype or is_fp8(cache_dtype)):
        return tl.float32, "ieee"
    dtype = _TL_DTYPES[query.dtype]
    return dtype, "ieee" if dtype == tl.float32 else "tf32"


def head_dim_pad(head_dim: int) -> int:
    """Block width of the head_dim axis: the next power of two, and at least 16 (tl.dot's minimum)."""
    return max(16, next_power_of_2(head_dim))


MAX_HEAD_DIM = 256  # equal widths: a [16, 256] fp32 accumulator plus K/V tiles is the most one program holds
MAX_V_HEAD_DIM_UNEQUAL = 512  # a latent V (DeepSeek's kv_lora_rank): the [16, 512] fp32 accumulator
MAX_K_TAIL = 128  # K's columns past V's padded width (DeepSeek's 64 rope columns)


@dataclass(frozen=True, slots=True)
class HeadDimBlocks:
    """How a kernel tiles K's and V's widths (see the module docstring): the constexprs of ``_attend_kv_tiles``."""

    head_dim_pad: int
    """K's padded width, or with a tail the width of its first part (V's padded width)."""
    k_tail_pad: int
    """Padded width of K's columns past ``head_dim_pad`` (16, unused, without a tail)."""
    has_k_tail: bool
    v_head_dim_pad: int

    @property
    def k_width(self) -> int:
        """Padded K columns a tile reads: what sizes the key tiles (``tile_rows``)."""
        return self.head_dim_pad + (self.k_tail_pad if self.has_k_tail else 0)


def head_dim_blocks(head_dim: int, v_head_dim: int, kernel: str) -> HeadDimBlocks:
    """Block widths for K ``head_dim`` and V ``v_head_dim`` wide (equal: one K block, as ever); ``ValueError``
    naming ``kernel`` for widths past its register budget."""
    v_pad = head_dim_pad(v_head_dim)
    if v_head_dim == head_dim:
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported by the {kernel} kernel")
        return HeadDimBlocks(v_pad, 16, False, v_pad)
    if v_head_dim > MAX_V_HEAD_DIM_UNEQUAL or head_dim - v_pad > MAX_K_TAIL:
        raise ValueError(
            f"key/value widths {head_dim}/{v_head_dim} are not supported by the {kernel} kernel (V up to "
            f"{MAX_V_HEAD_DIM_UNEQUAL}, K up to {MAX_K_TAIL} columns past V's padded width)"
        )
    if v_pad >= head_dim:  # K fits V's padded width: one K block
        return HeadDimBlocks(head_dim_pad(head_dim), 16, False, v_pad)
    return HeadDimBlocks(v_pad, head_dim_pad(head_dim - v_pad), True, v_pad)


def tile_rows(head_dim_padded: int, dot_dtype: tl.dtype) -> int:
    """Rows of a 16 KiB tile of padded head_dim vectors in ``dot_dtype``, clamped to [16, 64].

    Used for BLOCK_N (keys per loop iteration: K plus V tiles are 32 KiB of shared memory per
    pipeline stage) and for prefill's BLOCK_M (the Q tile, and its fp32 accumulator at twice the
    size, within one program's registers): 64 rows of fp16 at head_dim 128, 32 at 256 or for fp32
    dots at 128, 16 (tl.dot's minimum) for fp32 at 256.
    """
    row_bytes = head_dim_padded * dot_dtype.primitive_bitwidth // 8
    return min(64, max(16, (16 << 10) // row_bytes))


def kernel_scales(cache_dtype: torch.dtype, scale: float, k_scale: float, v_scale: float) -> tuple[float, float]:
    """(scale applied to q.k, scale applied to the output). fp8 caches store x / scale, so K's scale
    folds into the softmax scale and V's into the output; other caches ignore the scales."""
    if not is_fp8(cache_dtype):
        return float(scale), 1.0
    return float(scale) * float(k_scale), float(v_scale)
