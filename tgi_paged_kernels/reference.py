"""Pure fp32 PyTorch references for every kernel in this package.

These are the specification: obvious per-request, per-head loops, no masking tricks, no batching.
They read only the slots a request owns (positions < its ``seq_len``), so unused slots may hold
anything, NaN included. Tests compare both the Triton kernels and the plain-torch CPU paths
(``torch_impl``) against these; nothing on a fast path calls them.

Layouts (one layer):

- ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``; V may be narrower,
  ``[..., v_head_dim <= head_dim]``, and any view (a latent cache's V is ``k_cache[..., :v_head_dim]``):
  outputs then have ``v_head_dim`` columns
- slot ``s`` is block ``s // block_size``, offset ``s % block_size``
- token position ``p`` of request ``b`` lives in block ``block_tables[b, p // block_size]``,
  offset ``p % block_size``
"""

from __future__ import annotations

import torch

from ._checks import is_fp8


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Value as stored in a cache of ``dtype``: fp8 stores ``x / scale`` saturated to the finite
    range; other dtypes store ``x`` as is (scales apply to fp8 caches only)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    finite_max = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-finite_max, finite_max).to(dtype)


def dequantize(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 value of cache entries: ``fp8.float() * scale``, or the plain value for other dtypes."""
    if is_fp8(stored.dtype):
        return stored.float() * scale
    return stored.float()


def store_kv_reference(key, value, k_cache, v_cache, slot_mapping, *, k_scale=1.0, v_scale=1.0) -> None:
    """Write token ``i``'s K/V into slot ``slot_mapping[i]``, one token at a time; skip negative slots.
    ``value`` and ``v_cache`` ``None``: write the key only."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block_id, offset = divmod(slot, block_size)
        k_cache[block_id, offset] = quantize(key[i], k_cache.dtype, k_scale)
        if v_cache is not None:
            v_cache[block_id, offset] = quantize(value[i], v_cache.dtype, v_scale)


def gather_request_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """One request's first ``seq_len`` positions, in token order: ``[seq_len, num_kv_heads, cache.shape[3]]`` fp32."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len)
    block_ids = block_table_row.long().cpu()[positions // block_size]
    return dequantize(cache[block_ids, positions % block_size], scale)


def attend_one_request(
    q, k, v, q_positions, *, scale, softcap=0.0, sliding_window=None, sinks=None, alibi_slopes=None, key_limits=None
) -> torch.Tensor:
    """Causal attention of one request's queries over its keys, one query head at a time.

    Parameters
    ----------
    q : [num_queries, num_q_heads, head_dim] fp32
    k : [seq_len, num_kv_heads, head_dim] fp32, key position ``p`` at row ``p``
    v : [seq_len, num_kv_heads, v_head_dim] fp32 (``v_head_dim`` may differ from ``head_dim``)
    q_positions : [num_queries] token position of each query

    sinks : optional [num_q_heads], one learned logit per query head (gpt-oss attention sinks): it
        joins each row's softmax as one more score, with no value, so it only adds to the denominator
    alibi_slopes : optional [num_q_heads], ALiBi (Bloom, MPT): query head ``h`` adds
        ``alibi_slopes[h] * (key_position - query_position)`` to its scores, after scaling and soft-capping.
        HF writes the bias as ``slope * key_position`` (Bloom) or ``slope * (key_position - last_position)``
        (MPT); each differs from this one by a constant per query row, which the softmax cancels

    key_limits : optional [num_queries], the last key position each query sees (``>= q_positions[i]``; a
        bidirectional span: the span's last position); ``None``: each query's own position (causal)

    Query ``i`` sees key ``p`` when ``p <= key_limits[i]`` (``q_positions[i]`` without limits) and, with a window
    ``w``, ``p > q_positions[i] - w``. Rows that see no key return zeros. Returns
    ``[num_queries, num_q_heads, v_head_dim]``.
    """
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    queries_per_kv = num_q_heads // num_kv_heads
    key_positions = torch.arange(k.shape[0])
    reach = q_positions if key_limits is None else key_limits.long().cpu()
    visible = key_positions[None, :] <= reach[:, None]
    if sliding_window is not None:
        visible &= key_positions[None, :] > q_positions[:, None] - sliding_window
    out = torch.zeros((*q.shape[:2], v.shape[2]), dtype=torch.float32)
    for q_head in range(num_q_heads):
        kv_head = q_head // queries_per_kv
        scores = (q[:, q_head] @ k[:, kv_head].T) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes[q_head].float() * (key_positions[None, :] - q_positions[:, None]).float()
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more column: the sink's logit, after capping and masking (as HF does)
            scores = torch.cat([scores, sinks[q_head].float().expand(scores.shape[0], 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no visible key: all -inf -> NaN -> 0
        if sinks is not None:
            probs = probs[:, :-1]  # the sink takes its share of the mass and contributes no value
        out[:, q_head] = probs @ v[:, kv_head]
    return out


def paged_decode_attention_reference(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale,
    softcap=0.0,
    sliding_window=None,
    k_scale=1.0,
    v_scale=1.0,
    sinks=None,
    alibi_slopes=None,
) -> torch.Tensor:
    """Decode: request ``b``'s single query sits at position ``seq_lens[b] - 1``. Returns fp32 on CPU,
    ``[num_requests, num_q_heads, v_cache.shape[3]]``."""
    query, k_cache, v_cache = query.float().cpu(), k_cache.cpu(), v_cache.cpu()
    out = torch.zeros((*query.shape[:2], v_cache.shape[3]), dtype=torch.float32)
    for b, seq_len in enumerate(seq_lens.tolist()):
        k = gather_request_kv(k_cache, block_tables[b], seq_len, k_scale)
        v = gather_request_kv(v_cache, block_tables[b], seq_len, v_scale)
        q_positions = torch.tensor([seq_len - 1])
        out[b] = attend_one_request(
            query[b : b + 1],
            k,
            v,
            q_positions,
            scale=scale,
            softcap=softcap,
            sliding_window=sliding_window,
            sinks=None if sinks is None else sinks.cpu(),
            alibi_slopes=None if alibi_slopes is None else alibi_slopes.cpu(),
        )[0]
    return out


def paged_prefill_attention_reference(
    query,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    *,
    scale,
    softcap=0.0,
    sliding_window=None,
    k_scale=1.0,
    v_scale=1.0,
    sinks=None,
    alibi_slopes=None,
    attend_limits=None,
) -> torch.Tensor:
    """Prefill/extend: request ``b``'s queries are rows ``query_start_loc[b]:query_start_loc[b+1]`` at
    positions ``seq_lens[b] - q_len .. seq_lens[b] - 1``; ``attend_limits`` (optional ``[num_tokens]``): the
    last key position each row sees (``attend_one_request``'s ``key_limits``). Returns fp32 on CPU,
    ``[num_tokens, num_q_heads, v_cache.shape[3]]``."""
    query, k_cache, v_cache = query.float().cpu(), k_cache.cpu(), v_cache.cpu()
    starts = query_start_loc.tolist()
    out = torch.zeros((*query.shape[:2], v_cache.shape[3]), dtype=torch.float32)
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        k = gather_request_kv(k_cache, block_tables[b], seq_len, k_scale)
        v = gather_request_kv(v_cache, block_tables[b], seq_len, v_scale)
        q_positions = torch.arange(seq_len - (end - start), seq_len)
        out[start:end] = attend_one_request(
            query[start:end],
            k,
            v,
            q_positions,
            scale=scale,
            softcap=softcap,
            sliding_window=sliding_window,
            sinks=None if sinks is None else sinks.cpu(),
            alibi_slopes=None if alibi_slopes is None else alibi_slopes.cpu(),
            key_limits=None if attend_limits is None else attend_limits[start:end],
        )
    return out


def copy_blocks_reference(k_caches, v_caches, src, dst) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` in every layer's K and V pool, pair by pair."""
    for cache in [*k_caches, *v_caches]:
        for s, d in zip(src.tolist(), dst.tolist()):
            cache[d] = cache[s].clone()


def swap_blocks_reference(src_caches, dst_caches, src_ids, dst_ids) -> None:
    """Copy block ``src_ids[i]`` of each source pool to block ``dst_ids[i]`` of the matching destination
    pool (pool <-> swap space, any devices), pair by pair."""
    for src, dst in zip(src_caches, dst_caches):
        for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
            dst[d] = src[s].to(dst.device)
