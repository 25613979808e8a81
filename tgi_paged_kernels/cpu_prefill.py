"""Prefill attention over the paged pool as one native call per layer (``csrc/cpu_prefill.cpp``), CPU, fp32 queries.

Serves what :func:`tgi_paged_kernels.paged_prefill_attention` serves on CPU (prefill, chunked prefill,
prefix hits, recompute; windows, soft-cap, sinks; fp32, bf16 and fp8 pools) for every request of the step
at once, where the torch path makes one SDPA call per request (~100 us of host time each, 14 requests x
30 layers in the host-bound model's prefill); ``torch_impl.paged_prefill_attention_torch`` calls it for fp32
queries and keeps its per-request torch loop for the rest. Reference:
``reference.paged_prefill_attention_reference`` (``tests/kernels/test_cpu_prefill.py``).
"""

from __future__ import annotations

import torch

from .cpu_native import NativeKernels


def prefill_attention(
    native: NativeKernels,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    softcap: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
    attend_limits: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """fp32 ``[T, Hq, D]`` (arguments as ``paged_prefill_attention``'s), or ``None`` for inputs the kernel does not
    take (the caller runs the torch path). Raises ``ValueError`` for tables, lengths, block ids or key limits the
    kernel refuses before reading outside them."""
    num_tokens, num_q_heads, head_dim = query.shape
    index = (torch.int32, torch.int64)
    if (
        query.dtype != torch.float32
        or query.stride(-1) != 1
        or not query.is_cpu
        or not native.supports_cache(k_cache)
        or k_cache.shape != v_cache.shape
        or k_cache.stride() != v_cache.stride()
        or k_cache.dtype != v_cache.dtype
        or k_cache.shape[3] != head_dim
        or num_q_heads % k_cache.shape[2]
        or block_tables.dtype not in index
        or seq_lens.dtype not in index
        or query_start_loc.dtype not in index
        or block_tables.dim() != 2
        or query_start_loc.numel() != seq_lens.numel() + 1
        or block_tables.shape[0] < seq_lens.numel()
        or (sinks is not None and sinks.numel() != num_q_heads)
        or (attend_limits is not None and attend_limits.shape != (num_tokens,))
    ):
        return None
    starts = query_start_loc
    if int(starts[0]) != 0 or int(starts[-1]) != num_tokens or bool((starts[1:] < starts[:-1]).any()):
        raise ValueError(f"query_start_loc must rise from 0 to {num_tokens}, got {starts.tolist()}")
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    code, table = native.cache_dtype(k_cache)
    sinks_f32 = None if sinks is None else sinks.detach().float().contiguous()
    limits = None if attend_limits is None else attend_limits.to(torch.int64).contiguous()
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=torch.float32)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    status = native.prefill_attention(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), code, table,
        k_cache.shape[0], k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.data_ptr(), int(block_tables.dtype == torch.int64), block_tables.stride(0), block_tables.shape[1],
        query_start_loc.data_ptr(), int(query_start_loc.dtype == torch.int64),
        seq_lens.data_ptr(), int(seq_lens.dtype == torch.int64),
        out.data_ptr(), num_tokens, seq_lens.numel(), num_q_heads, num_kv_heads, head_dim, block_size,
        scale, softcap, int(sliding_window or 0), None if sinks_f32 is None else sinks_f32.data_ptr(),
        k_scale, v_scale, None if limits is None else limits.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status == 5:
        raise ValueError("attend_limits: every row's limit must be in [its position, its request's seq_len)")
    if status == 4:
        raise ValueError("query_start_loc must rise, and no request may have more queries than its seq_len")
    if status != 0:
        raise ValueError(native.decode_error(status, block_tables, seq_lens, block_size, k_cache.shape[0]))
    return out
