"""Fast CPU attention over the paged pool: one gather plan per step, one SDPA call per layer.

Serving on CPU (tests, the demo, the peers benchmark) spends a decode step in ~30 layer calls of
``paged_decode_attention``. Everything that depends only on the block tables and lengths -- which
pool blocks each request reads, which gathered positions are padding or outside the window -- is the
same in every layer, so it is computed once per step (:func:`plan_decode_gather`, a
:class:`DecodeGather`) and reused; each layer then does two ``index_select`` gathers of whole blocks,
zeroes the rows it must not read, and calls ``scaled_dot_product_attention`` once (GQA included)
instead of a masked matmul pair per KV head.

Rows a query never attends to (past ``seq_len``, or before the sliding window) are zeroed in the
gathered K *and* V: pool slots nobody owns may hold anything, and SDPA adds its mask to the scores,
so a NaN left in K there would survive the mask (the old path used ``masked_fill``, which replaces).
Computation is in fp32 whatever the cache dtype, as in the other CPU paths. Soft-capping and
attention sinks are not SDPA options: those calls take the per-KV-head path of ``torch_impl``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._checks import cdiv, value_views_key


@dataclass(frozen=True, slots=True)
class DecodeGather:
    """What every layer of one decode step reads from its pool (one request = one row).

    Build it with :func:`plan_decode_gather`; valid for any layer's pool with the same block size.
    """

    block_ids: torch.Tensor
    """int64 ``[num_requests * num_blocks]``: pool block of each (request, block column), 0 where unused."""
    hidden_rows: torch.Tensor | None
    """int64 ``[P]``: rows of the gathered ``[num_requests * num_positions]`` positions the query does not
    see (past ``seq_len`` or outside the window); zeroed in K and V. ``None`` in a padded plan, which
    zeroes every row ``visible`` masks instead (``P`` depends on the lengths' values)."""
    visible: torch.Tensor
    """bool ``[num_requests, 1, 1, num_positions]``: SDPA mask, True where the query attends."""
    num_requests: int
    block_size: int
    num_blocks: int
    """Block columns gathered per request (those of the longest request; a padded plan: the table's width)."""

    @property
    def num_positions(self) -> int:
        return self.num_blocks * self.block_size


def plan_decode_gather(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    *,
    padded: bool = False,
) -> DecodeGather:
    """The gather plan of a decode step (the query of request b is at position ``seq_lens[b] - 1``).

    ``padded``: gather the block table's whole width and zero hidden rows by mask, so every shape
    comes from the input shapes and no value is read on the host (the static decode step, which
    ``torch.compile`` traces and a CUDA graph captures); otherwise only the longest request's blocks.
    """
    num_requests = int(seq_lens.shape[0])
    lens = seq_lens.long()
    if padded:
        num_blocks = int(block_tables.shape[1])
    else:
        max_len = int(lens.max()) if num_requests else 0
        num_blocks = cdiv(max_len, block_size)
        if num_blocks > block_tables.shape[1]:
            raise ValueError(
                f"seq_lens up to {max_len} need {num_blocks} blocks, block_tables has {block_tables.shape[1]}"
            )
    used = torch.arange(num_blocks)[None, :] < cdiv_tensor(lens, block_size)[:, None]
    block_ids = torch.where(used, block_tables[:, :num_blocks].long(), 0).reshape(-1)
    positions = torch.arange(num_blocks * block_size)[None, :]
    visible = positions < lens[:, None]
    if sliding_window is not None:
        visible &= positions > lens[:, None] - 1 - sliding_window
    hidden_rows = None if padded else (~visible).reshape(-1).nonzero().squeeze(1)
    return DecodeGather(
        block_ids=block_ids,
        hidden_rows=hidden_rows,
        visible=visible[:, None, None, :],
        num_requests=num_requests,
        block_size=block_size,
        num_blocks=num_blocks,
    )


def value_is_key_prefix(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """Whether ``v_cache`` is ``k_cache[..., :v_head_dim]`` read with the same scale (a latent cache), so V can be
    sliced from K once K is gathered and dequantized instead of being gathered again."""
    return value_views_key(k_cache, v_cache) and k_scale == v_scale


def gather_decode_kv(cache: torch.Tensor, gather: DecodeGather, scale: float) -> torch.Tensor:
    """fp32 ``[num_requests, num_kv_heads, num_positions, head_dim]`` of one layer's pool, hidden rows zeroed.

    ``cache`` may be any view (a latent cache's V, ``k_cache[..., :v_head_dim]``): only its blocks are copied."""
    num_pool_blocks, block_size, num_kv_heads, head_dim = cache.shape
    if block_size != gather.block_size:
        raise ValueError(f"gather plan for block_size={gather.block_size}, the pool has {block_size}")
    if cache[0].is_contiguous():  # whole blocks are rows of one flat view
        rows = cache.view(num_pool_blocks, -1).index_select(0, gather.block_ids)
    else:  # a strided view: index_select copies the selected blocks into a contiguous tensor
        rows = cache.index_select(0, gather.block_ids)
    rows = rows.view(-1, num_kv_heads * head_dim)  # [num_requests * num_positions, heads * head_dim]
    rows = _dequantize(rows, scale)
    if gather.hidden_rows is None:  # padded plan: fixed shapes, hidden rows zeroed by the mask
        rows.masked_fill_(~gather.visible.reshape(-1, 1), 0.0)
    else:
        rows.index_fill_(0, gather.hidden_rows, 0.0)
    return rows.view(gather.num_requests, gather.num_positions, num_kv_heads, head_dim).transpose(1, 2)


def decode_attention_sdpa(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gather: DecodeGather,
    *,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """fp32 ``[num_requests, num_q_heads, v_head_dim]``: each request's one query over its gathered K/V."""
    k = gather_decode_kv(k_cache, gather, k_scale)
    if value_is_key_prefix(k_cache, v_cache, k_scale, v_scale):  # latent cache: V is K's first columns
        v = k[..., : v_cache.shape[3]]
    else:
        v = gather_decode_kv(v_cache, gather, v_scale)
    q = query.float()[:, :, None, :]  # [B, Hq, 1, D]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=gather.visible, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out[:, :, 0, :]


def prefill_attention_sdpa(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``[num_queries, num_q_heads, v_head_dim]`` of one request's queries over its K/V.

    ``k``, ``v``: fp32 ``[num_keys, num_kv_heads, head_dim]`` (``v``: ``v_head_dim``) at ``k_positions`` (every
    one owned and finite); queries at ``q_positions`` see keys at positions ``<=`` their own, or ``<=``
    ``key_limits`` (int64 ``[num_queries]``, a bidirectional span's last position) when given, and inside the window.
    """
    q = query.float().transpose(0, 1)[None]  # [1, Hq, Q, D]
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    gqa = kt.shape[1] != q.shape[1]
    fresh = sliding_window is None and key_limits is None and q_positions.shape[0] == k_positions.shape[0]
    if fresh:  # the queries are all the keys: plain causal
        out = F.scaled_dot_product_attention(q, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        reach = q_positions if key_limits is None else key_limits
        visible = k_positions[None, :] <= reach[:, None]
        if sliding_window is not None:
            visible &= k_positions[None, :] > q_positions[:, None] - sliding_window
        out = F.scaled_dot_product_attention(q, kt, vt, attn_mask=visible, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def cdiv_tensor(a: torch.Tensor, b: int) -> torch.Tensor:
    """Elementwise ceiling division of a non-negative integer tensor."""
    return (a + b - 1) // b


def _dequantize(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 copy of gathered cache rows (``index_select`` already copied: fp32 stays as is)."""
    if rows.dtype == torch.float32:
        return rows
    if rows.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return rows.float().mul_(scale)
    return rows.float()
