"""Plain-torch implementations behind the public functions for CPU tensors.

These serve small models on CPU (tests, the demo: SmolLM2-135M, batch 32, contexts up to ~1k).
Decode is vectorised across the batch over the step's gather plan (:mod:`.cpu_attention`: every
request's blocks gathered into one padded batch tensor, rows the query must not see zeroed), then one
SDPA call, or a masked matmul pair per KV head for soft-capping and sinks. Prefill loops over requests
(each request is already a large matmul).

Unused slots of the pool may hold anything, NaN included (pools come from ``torch.empty``). Rows a
query must not see are therefore masked in the scores *and* zeroed in the gathered K/V: ``0 * NaN``
is NaN, so a zero probability alone would not hide them.

V may be narrower than K and a strided view of it (a latent cache: ``v_cache = k_cache[..., :v_head_dim]``);
outputs then have ``v_head_dim`` columns. The native decode kernel reads V with K's strides (a latent view
qualifies); other narrower V pools, and native prefill, run the torch paths here.

Arguments are checked by the public functions in ``api``; only value-dependent checks live here.
"""

from __future__ import annotations

import torch

from .cpu_attention import (
    DecodeGather,
    decode_attention_sdpa,
    gather_decode_kv,
    plan_decode_gather,
    prefill_attention_sdpa,
    value_is_key_prefix,
)
from .cpu_decode import compiled_decode_attention
from .cpu_native import native_decode_for, native_kernels
from .cpu_prefill import prefill_attention
from .reference import dequantize, quantize


def store_kv_torch(key, value, k_cache, v_cache, slot_mapping, *, k_scale: float, v_scale: float) -> None:
    """Scatter token ``i``'s K/V into slot ``slot_mapping[i]``; negative slots are skipped. ``value`` and
    ``v_cache`` ``None``: the key only (a latent cache).

    Under ``torch.compile`` (the static decode step, whose padding rows write the scratch slot) the
    skip, a branch on values, is not traced: a negative slot raises there instead."""
    compiling = torch.compiler.is_compiling()
    native = None if compiling else native_kernels()
    if value is None:  # key only: the native kernel writes the same rows twice, still one call
        value, v_cache, v_scale = key, k_cache, k_scale
    if native is not None and native.store_kv(key, value, k_cache, v_cache, slot_mapping):
        return  # the native kernel copies rows of the pool's own dtype in one call
    slots = slot_mapping.long()
    if compiling:
        torch._assert_async((slots >= 0).all(), "store_kv: negative slots are not supported under torch.compile")
    elif bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    for cache, rows, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        rows = quantize(rows, cache.dtype, scale)
        if cache.is_contiguous():  # one row copy per token into the flat [slots, heads, head_dim] view
            flat = cache.view(-1, *cache.shape[2:])
            if cache.element_size() == 1:  # fp8: index_copy_ has no fp8 kernel; bytes are bytes
                flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
            flat.index_copy_(0, slots, rows)
        else:  # advanced-index assignment also works on non-contiguous cache views
            block_size = cache.shape[1]
            cache[slots // block_size, slots % block_size] = rows


def _attend_per_kv_head(q, k, v, visible, *, scale: float, softcap: float, sinks=None, bias=None) -> torch.Tensor:
    """Masked attention in fp32, one batched matmul pair per KV head.

    q: [batch, num_kv_heads, rows, head_dim], the rows of a KV head being its group's query heads
    (decode) or (query head, token) pairs (prefill); k, v: [batch, num_keys, num_kv_heads,
    head_dim], as gathered (the per-head slices are strided views: no copy, and no flops spent on
    other heads' keys); visible: bool, broadcastable to [batch, rows, num_keys]; sinks: optional
    fp32 [num_kv_heads, rows], each row's sink logit (an extra softmax column without a value); bias: optional
    fp32 [batch, num_kv_heads, rows, num_keys] added to the scores after soft-capping (ALiBi).
    Returns [batch, num_kv_heads, rows, head_dim]; rows that see no key give zeros.
    """
    outputs = []
    for kv_head in range(k.shape[2]):
        scores = torch.bmm(q[:, kv_head], k[:, :, kv_head].transpose(1, 2)).mul_(scale)
        if softcap > 0:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        if bias is not None:
            scores = scores.add_(bias[:, kv_head])
        scores = scores.masked_fill_(~visible, float("-inf"))
        if sinks is not None:
            sink_column = sinks[kv_head][None, :, None].expand(scores.shape[0], -1, 1)
            scores = torch.cat([scores, sink_column], dim=-1)
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # all -inf row -> NaN -> 0
        if sinks is not None:
            probs = probs[..., :-1]  # the sink's share of the mass carries no value
        outputs.append(torch.bmm(probs, v[:, :, kv_head]))
    return torch.stack(outputs, dim=1)


def paged_decode_attention_torch(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale,
    softcap,
    sliding_window,
    k_scale,
    v_scale,
    out,
    sinks=None,
    alibi_slopes=None,
    gather: DecodeGather | None = None,
    cpu_kernel: str = "native",
) -> torch.Tensor:
    """Decode for CPU tensors; see ``api.paged_decode_attention``. ``native``: the C++ kernel on the block
    tables as they are. ``compiled`` (and ``native`` under ``torch.compile``, which cannot trace a ctypes
    call): the inductor kernel over the plan's table. ``sdpa``, or when neither builds here: over the
    step's gather plan (``gather``, built here when not given), SDPA without soft-capping or sinks (and V as
    wide as K), else a masked matmul pair per KV head. ALiBi (``alibi_slopes``) always takes the masked matmul
    pair per KV head."""
    if gather is not None and gather.num_requests != query.shape[0]:
        raise ValueError(f"gather plan for {gather.num_requests} requests, the query has {query.shape[0]}")
    native_wanted = (
        cpu_kernel == "native" and alibi_slopes is None and not torch.compiler.is_compiling()
        # The C++ kernel reads V with K's strides: a narrower V only as a view of K (a latent cache) or alike
        and (v_cache.shape == k_cache.shape or v_cache.stride() == k_cache.stride())
    )  # fmt: skip
    native = native_decode_for(k_cache) if native_wanted else None
    if native is not None:
        direct = native.decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, scale, softcap, sliding_window, sinks, k_scale, v_scale
        )
        return _write_out(direct, query, out)
    compiled = cpu_kernel in ("native", "compiled") and alibi_slopes is None
    if gather is None:
        gather = plan_decode_gather(block_tables, seq_lens, k_cache.shape[1], sliding_window)
    if compiled:  # no gather: the compiled kernel reads the blocks in place (None: it cannot run here)
        table = gather.block_ids.view(gather.num_requests, gather.num_blocks)
        compiled_result = compiled_decode_attention()(
            query, k_cache, v_cache, table, seq_lens, scale, softcap, sliding_window, sinks, k_scale, v_scale
        )
        if compiled_result is not None:
            return _write_out(compiled_result, query, out)
    # SDPA's GQA expands K/V to every query head (16x the bytes for MLA's one latent head): a narrower V takes
    # the matmul pair per KV head, whose rows are the group's query heads (measured 20x faster at MLA's shape).
    if softcap == 0 and sinks is None and alibi_slopes is None and v_cache.shape == k_cache.shape:
        result = decode_attention_sdpa(query, k_cache, v_cache, gather, scale=scale, k_scale=k_scale, v_scale=v_scale)
    else:
        result = decode_per_kv_head(
            query, k_cache, v_cache, gather, scale=scale, softcap=softcap, k_scale=k_scale, v_scale=v_scale,
            sinks=sinks, alibi_slopes=alibi_slopes, seq_lens=seq_lens,
        )  # fmt: skip
    return _write_out(result, query, out)


def decode_per_kv_head(
    query, k_cache, v_cache, gather: DecodeGather, *, scale, softcap, k_scale, v_scale, sinks=None, alibi_slopes=None,
    seq_lens=None,
) -> torch.Tensor:  # fmt: skip
    """fp32 decode with a masked matmul pair per KV head (the soft-capping, sinks and ALiBi path), over the
    same gathered K/V (hidden rows zeroed) and mask as the SDPA path. ALiBi needs ``seq_lens`` (the query
    positions)."""
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    k = gather_decode_kv(k_cache, gather, k_scale).transpose(1, 2)  # [batch, positions, kv_heads, head_dim]
    if value_is_key_prefix(k_cache, v_cache, k_scale, v_scale):  # latent cache: V is K's first columns
        v = k[..., : v_cache.shape[3]]
    else:
        v = gather_decode_kv(v_cache, gather, v_scale).transpose(1, 2)
    # -- GQA: the queries_per_kv heads of a group are the "rows" of one KV head ---------------------
    q = query.float().reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    rows_sinks = None if sinks is None else sinks.float().reshape(num_kv_heads, num_q_heads // num_kv_heads)
    bias = None
    if alibi_slopes is not None:  # [B, Hkv, G, P]: slope * (key position - query position)
        relative = torch.arange(gather.num_positions)[None, :] - (seq_lens.long().cpu() - 1)[:, None]
        slopes = alibi_slopes.float().reshape(num_kv_heads, num_q_heads // num_kv_heads)
        bias = slopes[None, :, :, None] * relative[:, None, None, :].float()
    result = _attend_per_kv_head(
        q, k, v, gather.visible[:, 0], scale=scale, softcap=softcap, sinks=rows_sinks, bias=bias
    )
    return result.reshape(batch, num_q_heads, v_cache.shape[3])


def paged_prefill_attention_torch(
    query,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    *,
    scale,
    softcap,
    sliding_window,
    k_scale,
    v_scale,
    out,
    sinks=None,
    alibi_slopes=None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    attend_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill/extend for CPU tensors; see ``api.paged_prefill_attention``. fp32 queries (bf16 and fp16 ones
    widened) go to the native kernel (:mod:`.cpu_prefill`: all requests in one call) when it is built; the rest runs
    here, one request at a time (the native kernel's reference). ALiBi (``alibi_slopes``) always runs here, a masked
    matmul pair per KV head. ``attend_limits``: each row's last visible key position (bidirectional spans),
    ``None``: causal."""
    native = None if torch.compiler.is_compiling() or alibi_slopes is not None else native_kernels()
    if native is not None:
        # bf16 / fp16 queries widened: the kernel computes in fp32, as the per-request path below does
        wide = query.float() if query.dtype in (torch.bfloat16, torch.float16) else query
        result = prefill_attention(
            native, wide, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale=scale, softcap=softcap,
            sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale, attend_limits=attend_limits,
        )  # fmt: skip
        if result is not None:
            return _write_out(result, query, out)
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads, v_head_dim = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    v_from_k = value_is_key_prefix(k_cache, v_cache, k_scale, v_scale)  # latent cache: V is K's first columns
    queries_per_kv = num_q_heads // num_kv_heads
    starts = query_start_loc.tolist()
    if starts[0] != 0 or starts[-1] != num_tokens or any(a > b for a, b in zip(starts, starts[1:])):
        raise ValueError(f"query_start_loc must rise from 0 to {num_tokens}, got {starts}")
    result = torch.zeros((num_tokens, num_q_heads, v_head_dim), dtype=torch.float32)
    group_sinks = None if sinks is None else sinks.float().reshape(num_kv_heads, queries_per_kv, 1)
    group_slopes = None if alibi_slopes is None else alibi_slopes.float().reshape(num_kv_heads, queries_per_kv, 1, 1)
    # A request without a cached prefix attends over its own new K/V: no read back from the pool when the
    # pool stores them as they are.
    fresh_kv = new_kv if new_kv is not None and new_kv[0].dtype == k_cache.dtype else None
    limits = None if attend_limits is None else attend_limits.long().cpu()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        num_queries = end - start
        if num_queries == 0:
            continue
        row_limits = None if limits is None else limits[start:end]
        if row_limits is not None and not (
            (row_limits >= torch.arange(seq_len - num_queries, seq_len)).all() and (row_limits < seq_len).all()
        ):
            raise ValueError(f"request {b}: attend_limits must lie in [each row's position, seq_len {seq_len})")
        if not num_queries <= seq_len <= block_tables.shape[1] * block_size:
            raise ValueError(
                f"request {b}: seq_len {seq_len} must cover its {num_queries} queries and fit its block table"
            )
        if softcap == 0 and sinks is None and alibi_slopes is None:  # common case: SDPA over the keys some query sees
            first = seq_len - num_queries
            lo = 0 if sliding_window is None else max(0, first - sliding_window + 1)
            positions = torch.arange(lo, seq_len)
            if fresh_kv is not None and first == 0:  # the keys are exactly this request's new tokens
                k = dequantize(fresh_kv[0][start:end], k_scale)
                v = dequantize(fresh_kv[1][start:end], v_scale)
            else:
                block_ids = block_tables[b, positions // block_size].long()
                k = dequantize(k_cache[block_ids, positions % block_size], k_scale)
                v = k[..., :v_head_dim] if v_from_k else dequantize(v_cache[block_ids, positions % block_size], v_scale)
            result[start:end] = prefill_attention_sdpa(
                query[start:end],
                k,
                v,
                torch.arange(first, seq_len),
                positions,
                scale=scale,
                sliding_window=sliding_window,
                key_limits=row_limits,
            )
            continue
        # -- this request's K/V, positions 0 .. seq_len-1 only: nothing to mask out in V ----------
        positions = torch.arange(seq_len)
        block_ids = block_tables[b, positions // block_size].long()
        k = dequantize(k_cache[block_ids, positions % block_size], k_scale)  # [seq_len, kv_heads, D]
        v = k[..., :v_head_dim] if v_from_k else dequantize(v_cache[block_ids, positions % block_size], v_scale)
        # -- causal (+ window) mask of queries at positions seq_len-num_queries .. seq_len-1 ---------
        q_positions = torch.arange(seq_len - num_queries, seq_len)
        visible = positions[None, :] <= (q_positions if row_limits is None else row_limits)[:, None]
        if sliding_window is not None:
            visible &= positions[None, :] > q_positions[:, None] - sliding_window
        # -- rows of a KV head: (head in group, token) pairs, head-major ------------------------------
        q = query[start:end].float().reshape(num_queries, num_kv_heads, queries_per_kv, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(1, num_kv_heads, queries_per_kv * num_queries, head_dim)
        rows_sinks = None if group_sinks is None else group_sinks.expand(-1, -1, num_queries).reshape(num_kv_heads, -1)
        bias = None
        if group_slopes is not None:  # [1, Hkv, G * Q, S]: slope * (key position - query position), head-major rows
            relative = (positions[None, :] - q_positions[:, None]).float()
            bias = (group_slopes * relative).reshape(1, num_kv_heads, queries_per_kv * num_queries, seq_len)
        o = _attend_per_kv_head(q, k[None], v[None], visible.repeat(queries_per_kv, 1)[None], scale=scale,
                                softcap=softcap, sinks=rows_sinks, bias=bias)  # fmt: skip
        o = o.reshape(num_kv_heads, queries_per_kv, num_queries, v_head_dim)
        result[start:end] = o.permute(2, 0, 1, 3).reshape(num_queries, num_q_heads, v_head_dim)
    return _write_out(result, query, out)


def _write_out(result: torch.Tensor, query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


def copy_blocks_torch(k_caches, v_caches, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In-pool block copies: block ``src[i]`` -> block ``dst[i]`` in every layer's K and V pool."""
    src, dst = src.long(), dst.long()
    for cache in [*k_caches, *v_caches]:
        cache[dst] = cache[src]  # the right side is gathered first, so sources read pre-copy values
