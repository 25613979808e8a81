"""Paged decode attention: one query token per request over its K/V in the block pool.

Two schedules, one kernel:

- **single pass** (``NUM_SPLITS == 1``): program (request, KV head) walks the whole context and
  writes the normalised output.
- **split-K / flash-decoding** (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
  inference", 2023): program (request, KV head, split) walks one slice of the context and writes
  an unnormalised partial output plus its log-sum-exp; ``_paged_decode_reduce_kernel`` merges the
  slices. This fills the GPU when batch x KV heads is small and contexts are long.

``choose_num_splits`` picks the schedule from shapes only (no device sync): the context bound is
the block table's width, not ``seq_lens``.

The query heads of one GQA group are the rows of one ``tl.dot`` (padded to 16 rows, tl.dot's
minimum), so each K/V tile is read from memory once per group. The math is in ``_attention_tiles``, which
also takes V narrower than K (multi-head latent attention: outputs are then ``v_head_dim`` wide).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_tiles import (
    LOG2E,
    HeadDimBlocks,
    _add_sink,
    _attend_kv_tiles,
    _load_query_rows,
    dot_dtype_and_precision,
    head_dim_blocks,
    kernel_scales,
    tile_rows,
)
from ._checks import AttentionShape, cdiv, check_attention, check_index, check_unit_inner_stride, next_power_of_2

MAX_SPLITS = 64  # the reduction holds all splits' partial rows of one head at once: 64 x 256 fp32 = 64 KiB
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost (query load, partial write, merge) outweighs its reads
PROGRAMS_PER_SM = 2  # split until about two programs per SM are in flight, so one can load while one computes


@triton.jit
def _paged_decode_kernel(
    query_ptr,
    stride_qb,
    stride_qh,
    stride_qd,  #
    k_cache_ptr,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,  #
    v_cache_ptr,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,  #
    block_tables_ptr,
    stride_btb,  #
    seq_lens_ptr,  #
    out_ptr,
    stride_ob,
    stride_oh,
    stride_od,  #
    part_out_ptr,
    part_lse_ptr,  # split-K only: [B, Hq, NUM_SPLITS, V_HEAD_DIM], [B, Hq, NUM_SPLITS] fp32
    sinks_ptr,  # [Hq] sink logits (USE_SINKS); split-K adds them in the reduction instead
    alibi_slopes_ptr,  # [Hq] fp32 ALiBi slopes (USE_ALIBI)
    sm_scale,
    v_scale,
    softcap,
    sliding_window,
    tokens_per_split,  #
    NUM_Q_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,  #
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    K_TAIL_PAD: tl.constexpr,
    HAS_K_TAIL: tl.constexpr,  #
    V_HEAD_DIM: tl.constexpr,
    V_HEAD_DIM_PAD: tl.constexpr,  #
    NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,  #
    USE_ALIBI: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  #
):
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # -- key range: [window start (aligned down to a tile), seq_len), then this split's slice ------
    seq_len = tl.load(seq_lens_ptr + request).to(tl.int32)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - sliding_window, 0) // BLOCK_N * BLOCK_N
    kv_hi = seq_len
    if NUM_SPLITS > 1:
        kv_lo = kv_lo + split * tokens_per_split  # tokens_per_split is a multiple of BLOCK_N
        kv_hi = tl.minimum(kv_lo + tokens_per_split, seq_len)

    # -- rows = the query heads of this KV head's group, padded to BLOCK_M ------------------------
    offs_m = tl.arange(0, BLOCK_M)
    q_head = kv_head * QUERIES_PER_KV + offs_m
    row_mask = offs_m < QUERIES_PER_KV
    q, q_tail = _load_query_rows(
        query_ptr, request * stride_qb + q_head * stride_qh, row_mask, stride_qd,  #
        BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, K_TAIL_PAD, HAS_K_TAIL, DOT_DTYPE,
    )  # fmt: skip
    offs_v = tl.arange(0, V_HEAD_DIM_PAD)
    io_mask = row_mask[:, None] & (offs_v < V_HEAD_DIM)[None, :]  # output rows: V's width
    q_pos = tl.full((BLOCK_M,), 0, tl.int32) + (seq_len - 1)  # the decode token is the last position

    alibi_slope = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if USE_ALIBI:
        alibi_slope = tl.load(alibi_slopes_ptr + q_head, mask=row_mask, other=0.0)

    # -- online softmax over the key tiles ----------------------------------------------------------
    acc, m_i, l_i = _attend_kv_tiles(
        q,
        q_tail,
        q_pos,
        q_pos,  # decode: causal, each row sees up to itself
        kv_lo,
        kv_hi,  #
        block_tables_ptr + request.to(tl.int64) * stride_btb,  #
        k_cache_ptr + kv_head * stride_kh,
        stride_kb,
        stride_ks,
        stride_kd,  #
        v_cache_ptr + kv_head * stride_vh,
        stride_vb,
        stride_vs,
        stride_vd,  #
        sm_scale,
        softcap,
        sliding_window,
        alibi_slope,  #
        BLOCK_M,
        BLOCK_SIZE,
        BLOCK_N,
        HEAD_DIM,
        HEAD_DIM_PAD,
        K_TAIL_PAD,
        HAS_K_TAIL,
        V_HEAD_DIM,
        V_HEAD_DIM_PAD,
        USE_SOFTCAP,
        USE_WINDOW,
        USE_ALIBI,
        DOT_DTYPE,
        DOT_PRECISION,  #
    )

    # -- epilogue: the sink joins the denominator once (here, or in the reduction when split), then
    # normalise (an empty range, l_i == 0, gives zeros) -----------------------------------------------
    if USE_SINKS and NUM_SPLITS == 1:
        sink = tl.load(sinks_ptr + q_head, mask=row_mask, other=0.0).to(tl.float32)
        acc, m_i, l_i = _add_sink(acc, m_i, l_i, sink)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    result = acc * (v_scale / l_safe)[:, None]
    if NUM_SPLITS == 1:
        out_offs = request * stride_ob + q_head[:, None] * stride_oh + offs_v[None, :] * stride_od
        tl.store(out_ptr + out_offs, result.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        part_row = (request * NUM_Q_HEADS + q_head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part_row[:, None] * V_HEAD_DIM + offs_v[None, :], result, mask=io_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # base 2, like m_i
        tl.store(part_lse_ptr + part_row, lse, mask=row_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,  # [B, Hq, NUM_SPLITS, HEAD_DIM], [B, Hq, NUM_SPLITS] fp32, contiguous (HEAD_DIM: V's width)
    out_ptr,
    stride_ob,
    stride_oh,
    stride_od,  #
    sinks_ptr,  # [Hq] sink logits (USE_SINKS)
    NUM_Q_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  #
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,  #
):
    request = tl.program_id(0)
    q_head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < NUM_SPLITS
    part_row = (request * NUM_Q_HEADS + q_head) * NUM_SPLITS + offs_s

    # -- weights: each split's share of the softmax mass, exp2(lse_s - max lse); the sink (base 2,
    # like lse) is one more share without a value -----------------------------------------------------
    lse = tl.load(part_lse_ptr + part_row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + q_head).to(tl.float32) * LOG2E
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: all weights 0
    weight = tl.exp2(lse - lse_max)

    # -- merge the normalised partial outputs ----------------------------------------------------------
    part_mask = s_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    part = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], mask=part_mask, other=0.0)
    total = tl.sum(weight, axis=0)
    if USE_SINKS:
        total += tl.exp2(sink - lse_max)
    result = tl.sum(weight[:, None] * part, axis=0) / tl.where(total > 0, total, 1.0)
    out_offs = request * stride_ob + q_head * stride_oh + offs_d * stride_od
    tl.store(out_ptr + out_offs, result.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def choose_num_splits(num_programs: int, max_context: int, num_sms: int) -> int:
    """Number of context slices per (request, KV head), from shapes only.

    Split only when the single-pass grid (``num_programs`` = requests x KV heads) leaves the GPU
    under-filled, into as many slices as reach ``PROGRAMS_PER_SM`` programs per SM, but never into
    slices shorter than ``MIN_TOKENS_PER_SPLIT`` tokens nor more than ``MAX_SPLITS``.
    """
    wanted = cdiv(PROGRAMS_PER_SM * num_sms, max(num_programs, 1))
    return max(1, min(wanted, max_context // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # interpreter: no SMs to fill, so automatic choice stays single pass


def _check_decode(
    shape: AttentionShape, query, k_cache, v_cache, block_tables, seq_lens, out
) -> HeadDimBlocks:  # fmt: skip
    """Decode-only checks, on top of ``check_attention``'s; returns the kernel's head-dim blocks."""
    batch = shape.num_rows
    check_index("seq_lens", seq_lens, (batch,), query.device)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {batch} requests")
    blocks = head_dim_blocks(shape.cache.head_dim, shape.cache.v_head_dim, "decode")
    check_unit_inner_stride(query=query, k_cache=k_cache, v_cache=v_cache, out=out, block_tables=block_tables)
    return blocks


def _split_plan(
    num_splits: int | None,
    shape: AttentionShape,
    table_width: int,
    sliding_window: int | None,
    block_n: int,
    device: torch.device,
) -> tuple[int, int]:
    """(number of slices, tokens per slice) for a decode call; ``num_splits`` None: by shape."""
    # Longest key range any request can have: the table's width, or the window plus tile alignment.
    max_context = table_width * shape.cache.block_size
    if sliding_window is not None:
        max_context = min(max_context, sliding_window + block_n)
    chosen = num_splits is None
    if num_splits is None:
        num_splits = choose_num_splits(shape.num_rows * shape.cache.num_kv_heads, max_context, _num_sms(device))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    tokens_per_split = cdiv(cdiv(max_context, num_splits), block_n) * block_n  # a multiple of BLOCK_N
    if chosen:  # rounding slices up to whole tiles may leave the last one empty for every request: drop it
        num_splits = cdiv(max_context, tokens_per_split)
    return num_splits, tokens_per_split


def _launch_paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    softcap: float = 0.0,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Check arguments and launch the Triton decode kernel(s), whatever the device.

    Parameters
    ----------
    query : [B, num_q_heads, head_dim], fp16/bf16/fp32, head_dim contiguous
    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim], any cache dtype, head_dim
        contiguous (other strides free); V may be narrower (``v_head_dim``), e.g. the view ``k_cache[..., :Dv]``
    block_tables : int32 [B, max_blocks], rows contiguous; seq_lens : int32 [B]
    scale, softcap, sliding_window, k_scale, v_scale, out, sinks, alibi_slopes : as ``api.paged_decode_attention``
    num_splits : ``None`` chooses by shape (``choose_num_splits``); 1 forces the single pass; > 1
        forces split-K with that many slices (tests use this under ``TRITON_INTERPRET=1``)

    Returns
    -------
    ``out`` (allocated like ``query`` if not given): [B, num_q_heads, v_head_dim]
    """
    shape = check_attention(
        query, k_cache, v_cache, block_tables,
        softcap=softcap, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, out=out, sinks=sinks,
        alibi_slopes=alibi_slopes,
    )  # fmt: skip
    cache, batch = shape.cache, shape.num_rows
    if out is None:
        out = query.new_empty((batch, shape.num_q_heads, cache.v_head_dim))
    blocks = _check_decode(shape, query, k_cache, v_cache, block_tables, seq_lens, out)
    if batch == 0:
        return out

    dot_dtype, dot_precision = dot_dtype_and_precision(query, k_cache.dtype)
    block_n = tile_rows(blocks.k_width, dot_dtype)
    num_splits, tokens_per_split = _split_plan(
        num_splits, shape, block_tables.shape[1], sliding_window, block_n, query.device
    )
    sm_scale, out_scale = kernel_scales(k_cache.dtype, scale, k_scale, v_scale)
    if num_splits > 1:
        part_out = torch.empty(batch, shape.num_q_heads, num_splits, cache.v_head_dim, device=query.device)
        part_lse = torch.empty(batch, shape.num_q_heads, num_splits, device=query.device)
    else:
        part_out = part_lse = out  # unused by the single pass; any pointer will do
    _paged_decode_kernel[(batch, cache.num_kv_heads, num_splits)](
        query, *query.stride(),  #
        k_cache, *k_cache.stride(),  #
        v_cache, *v_cache.stride(),  #
        block_tables, block_tables.stride(0),  #
        seq_lens,  #
        out, *out.stride(),  #
        part_out, part_lse,  #
        out if sinks is None else sinks,  # any pointer when unused
        out if alibi_slopes is None else alibi_slopes,  #
        sm_scale, out_scale, softcap, sliding_window or 0, tokens_per_split,  #
        NUM_Q_HEADS=shape.num_q_heads, QUERIES_PER_KV=shape.queries_per_kv,  #
        BLOCK_M=max(16, next_power_of_2(shape.queries_per_kv)),  # 16: tl.dot's minimum rows
        BLOCK_SIZE=cache.block_size, BLOCK_N=block_n, HEAD_DIM=cache.head_dim, HEAD_DIM_PAD=blocks.head_dim_pad,  #
        K_TAIL_PAD=blocks.k_tail_pad, HAS_K_TAIL=blocks.has_k_tail,  #
        V_HEAD_DIM=cache.v_head_dim, V_HEAD_DIM_PAD=blocks.v_head_dim_pad,  #
        NUM_SPLITS=num_splits, USE_SOFTCAP=softcap > 0, USE_WINDOW=sliding_window is not None,  #
        USE_SINKS=sinks is not None, USE_ALIBI=alibi_slopes is not None,  #
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,  #
    )  # fmt: skip
    if num_splits > 1:
        _paged_decode_reduce_kernel[(batch, shape.num_q_heads)](
            part_out, part_lse,  #
            out, *out.stride(),  #
            out if sinks is None else sinks,  #
            NUM_Q_HEADS=shape.num_q_heads, NUM_SPLITS=num_splits, SPLITS_PAD=next_power_of_2(num_splits),  #
            HEAD_DIM=cache.v_head_dim, HEAD_DIM_PAD=blocks.v_head_dim_pad, USE_SINKS=sinks is not None,  #
        )  # fmt: skip
    return out
