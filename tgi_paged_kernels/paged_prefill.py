"""Paged prefill / extend attention: many requests' new tokens, packed, causal over each request's
cached prefix plus its new tokens, all read from the block pool.

This one kernel serves a first prefill (no prefix), chunked prefill (earlier chunks in the pool),
prefix-cache hits (shared blocks in the pool) and recompute after preemption: the caller has stored
the new tokens' K/V before the call, so for request ``b`` every position ``< seq_lens[b]`` is in the
pool and its ``q_len`` queries sit at positions ``seq_lens[b] - q_len .. seq_lens[b] - 1``::

    position:  0 ............................ seq_len - q_len ........ seq_len - 1
               |<- cached prefix (no mask) ->|<- new tokens (causal) ->|

Work split: rows are (query token, query head of the GQA group) pairs, token-major, so a tile of
``BLOCK_M`` rows covers ``BLOCK_M / queries_per_kv`` tokens of one request and one KV head. The grid
is flat over tiles of all requests; request ``b``'s tiles start at tile
``query_start_loc[b] * queries_per_kv // BLOCK_M + b``, a layout every program computes from
``query_start_loc`` alone (no host sync, no extra index tensor). That start is an upper bound on the
tiles all earlier requests need, so a few programs find no rows and return.

V may be narrower than K (multi-head latent attention); outputs are then ``v_head_dim`` wide.

Bidirectional spans (``attend_limits``, ``USE_LIMITS``): each row sees keys up to its token's limit instead of
up to itself (a token of an image or of a prefix-LM prompt sees its whole span); a tile then reads keys up to the
largest limit of its tokens. Without limits the kernel is the causal one (the limit is the position).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attention_tiles import (
    _add_sink,
    _attend_kv_tiles,
    _load_query_rows,
    dot_dtype_and_precision,
    head_dim_blocks,
    kernel_scales,
    tile_rows,
)
from ._checks import check_attention, check_index, check_unit_inner_stride, next_power_of_2


@triton.jit
def _locate_tile(tile, query_start_loc_ptr, num_requests, QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr,
                 REQUESTS_PAD: tl.constexpr):  # fmt: skip
    # The request owning this tile is the last one whose first tile is <= tile (first tiles rise).
    offs_r = tl.arange(0, REQUESTS_PAD)
    starts = tl.load(query_start_loc_ptr + offs_r, mask=offs_r < num_requests, other=0)
    first_tiles = tl.where(offs_r < num_requests, starts * QUERIES_PER_KV // BLOCK_M + offs_r, 2**30)
    request = tl.sum((first_tiles <= tile).to(tl.int32), axis=0) - 1
    q_start = tl.load(query_start_loc_ptr + request).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + request + 1).to(tl.int32) - q_start
    row_start = (tile - (q_start * QUERIES_PER_KV // BLOCK_M + request)) * BLOCK_M  # first packed row
    return request, q_start, q_len, row_start


@triton.jit
def _paged_prefill_kernel(
    query_ptr,
    stride_qt,
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
    query_start_loc_ptr,
    seq_lens_ptr,
    num_requests,  #
    out_ptr,
    stride_ot,
    stride_oh,
    stride_od,  #
    sinks_ptr,  # [Hq] sink logits (USE_SINKS)
    alibi_slopes_ptr,  # [Hq] fp32 ALiBi slopes (USE_ALIBI)
    limits_ptr,  # [T] last key position of each token (USE_LIMITS)
    sm_scale,
    v_scale,
    softcap,
    sliding_window,  #
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    REQUESTS_PAD: tl.constexpr,  #
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    K_TAIL_PAD: tl.constexpr,
    HAS_K_TAIL: tl.constexpr,  #
    V_HEAD_DIM: tl.constexpr,
    V_HEAD_DIM_PAD: tl.constexpr,  #
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,  #
    USE_ALIBI: tl.constexpr,
    USE_LIMITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  #
):
    kv_head = tl.program_id(1)
    request, q_start, q_len, row_start = _locate_tile(
        tl.program_id(0), query_start_loc_ptr, num_requests, QUERIES_PER_KV, BLOCK_M, REQUESTS_PAD
    )
    if row_start >= q_len * QUERIES_PER_KV:
        return  # this request has fewer tiles than its allotment

    # -- rows: token-major (token, head in group) pairs; their positions -------------------------------
    seq_len = tl.load(seq_lens_ptr + request).to(tl.int32)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    row_mask = offs_m < q_len * QUERIES_PER_KV
    token = offs_m // QUERIES_PER_KV
    q_head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    q_pos = seq_len - q_len + token
    q, q_tail = _load_query_rows(
        query_ptr, (q_start + token) * stride_qt + q_head * stride_qh, row_mask, stride_qd,  #
        BLOCK_M, HEAD_DIM, HEAD_DIM_PAD, K_TAIL_PAD, HAS_K_TAIL, DOT_DTYPE,
    )  # fmt: skip
    offs_v = tl.arange(0, V_HEAD_DIM_PAD)
    io_mask = row_mask[:, None] & (offs_v < V_HEAD_DIM)[None, :]  # output rows: V's width

    # -- key range: causal up to the tile's last token, from its first token's window start ----------
    first_pos = seq_len - q_len + row_start // QUERIES_PER_KV
    last_pos = seq_len - q_len + tl.minimum((row_start + BLOCK_M - 1) // QUERIES_PER_KV, q_len - 1)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    kv_hi = last_pos + 1
    q_reach = q_pos
    if USE_LIMITS:  # bidirectional spans: up to each token's limit, the tile up to its largest
        q_reach = tl.load(limits_ptr + q_start + token, mask=row_mask, other=0).to(tl.int32)
        q_reach = tl.maximum(q_reach, q_pos)
        kv_hi = tl.maximum(kv_hi, tl.max(tl.where(row_mask, q_reach, 0), axis=0) + 1)

    alibi_slope = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if USE_ALIBI:
        alibi_slope = tl.load(alibi_slopes_ptr + q_head, mask=row_mask, other=0.0)

    # -- online softmax over the key tiles -----------------------------------------------------------
    acc, m_i, l_i = _attend_kv_tiles(
        q,
        q_tail,
        q_pos,
        q_reach,
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

    # -- epilogue: the sink joins the denominator, then normalise and store (every row sees at least
    # itself, so l_i > 0) ----------------------------------------------------------------------------------
    if USE_SINKS:
        sink = tl.load(sinks_ptr + q_head, mask=row_mask, other=0.0).to(tl.float32)
        acc, m_i, l_i = _add_sink(acc, m_i, l_i, sink)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    result = acc * (v_scale / l_safe)[:, None]
    out_offs = (q_start + token)[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_v[None, :] * stride_od
    tl.store(out_ptr + out_offs, result.to(out_ptr.dtype.element_ty), mask=io_mask)


def _launch_paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    softcap: float = 0.0,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    attend_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Check arguments and launch the Triton prefill kernel, whatever the device.

    Parameters
    ----------
    query : [num_tokens, num_q_heads, head_dim], fp16/bf16/fp32, head_dim contiguous
    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim], any cache dtype, head_dim
        contiguous (other strides free); V may be narrower (``v_head_dim``), e.g. the view ``k_cache[..., :Dv]``
    block_tables : int32 [B, max_blocks], rows contiguous
    query_start_loc : int32 [B + 1]; seq_lens : int32 [B]
    scale, softcap, sliding_window, k_scale, v_scale, out, sinks, alibi_slopes, attend_limits : as
        ``api.paged_prefill_attention`` (a limit past its request's ``seq_len - 1`` would read slots it does not own)

    Returns
    -------
    ``out`` (allocated like ``query`` if not given): [num_tokens, num_q_heads, v_head_dim]
    """
    shape = check_attention(
        query, k_cache, v_cache, block_tables,
        softcap=softcap, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, out=out, sinks=sinks,
        alibi_slopes=alibi_slopes,
    )  # fmt: skip
    cache = shape.cache
    num_requests = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_index("seq_lens", seq_lens, (num_requests,), query.device)
    check_index("query_start_loc", query_start_loc, (num_requests + 1,), query.device)
    if attend_limits is not None:
        check_index("attend_limits", attend_limits, (shape.num_rows,), query.device)
    if block_tables.shape[0] != num_requests:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_requests} requests")
    blocks = head_dim_blocks(cache.head_dim, cache.v_head_dim, "Triton prefill")
    if out is None:
        out = query.new_empty((shape.num_rows, shape.num_q_heads, cache.v_head_dim))
    check_unit_inner_stride(query=query, k_cache=k_cache, v_cache=v_cache, out=out, block_tables=block_tables)
    if num_requests == 0 or shape.num_rows == 0:
        return out

    dot_dtype, dot_precision = dot_dtype_and_precision(query, k_cache.dtype)
    block_m = tile_rows(blocks.k_width, dot_dtype)
    # Tiles: request b gets tiles [qsl[b] * G // BLOCK_M + b, qsl[b+1] * G // BLOCK_M + b + 1).
    num_tiles = shape.num_rows * shape.queries_per_kv // block_m + num_requests
    sm_scale, out_scale = kernel_scales(k_cache.dtype, scale, k_scale, v_scale)
    _paged_prefill_kernel[(num_tiles, cache.num_kv_heads)](
        query, *query.stride(),  #
        k_cache, *k_cache.stride(),  #
        v_cache, *v_cache.stride(),  #
        block_tables, block_tables.stride(0),  #
        query_start_loc, seq_lens, num_requests,  #
        out, *out.stride(),  #
        out if sinks is None else sinks,  # any pointer when unused
        out if alibi_slopes is None else alibi_slopes,  #
        out if attend_limits is None else attend_limits,  #
        sm_scale, out_scale, softcap, sliding_window or 0,  #
        QUERIES_PER_KV=shape.queries_per_kv, BLOCK_M=block_m, REQUESTS_PAD=next_power_of_2(num_requests),  #
        BLOCK_SIZE=cache.block_size, BLOCK_N=block_m, HEAD_DIM=cache.head_dim,  #
        HEAD_DIM_PAD=blocks.head_dim_pad, K_TAIL_PAD=blocks.k_tail_pad, HAS_K_TAIL=blocks.has_k_tail,  #
        V_HEAD_DIM=cache.v_head_dim, V_HEAD_DIM_PAD=blocks.v_head_dim_pad,  #
        USE_SOFTCAP=softcap > 0, USE_WINDOW=sliding_window is not None,  #
        USE_SINKS=sinks is not None, USE_ALIBI=alibi_slopes is not None, USE_LIMITS=attend_limits is not None,  #
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,  #
    )  # fmt: skip
    return out
