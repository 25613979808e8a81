"""The public kernel functions the model runner calls.

Each dispatches on the tensors' device: CUDA -> the Triton launchers (``_launch_*`` in the kernel
modules, importable directly to force the Triton path, e.g. under ``TRITON_INTERPRET=1`` on CPU);
anything else -> the plain-torch paths in ``torch_impl``. Triton is imported only on the CUDA path:
it is installed on Linux only, and CPU serving must not need it.

Layouts (one layer; the runner owns one K and one V pool per layer)::

    k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]
    slot             : block_id * block_size + offset
    block_tables     : int32 [num_requests, max_blocks], request b's position p is in block
                       block_tables[b, p // block_size] at offset p % block_size

Unequal key/value widths (multi-head latent attention, DeepSeek-V2/V3): a latent pool holds one entry per
token, ``k_cache [num_blocks, block_size, 1, Dk]`` with ``Dk = kv_lora_rank + qk_rope_head_dim``, and the
value is its first ``Dv = kv_lora_rank`` columns, passed as the view ``v_cache = k_cache[..., :Dv]`` (no
copy). Queries are ``[rows, num_q_heads, Dk]`` (absorbed into the key up-projection), outputs (and ``out``)
``[rows, num_q_heads, Dv]``. ``store_kv(latent, None, k_cache, None, slots)`` writes the entry. Any ``v_cache``
of ``k_cache``'s first three dims and a width ``<= Dk`` is accepted; equal widths behave as before.

Scales: an fp8 cache (float8_e4m3fn / float8_e5m2) stores ``x / scale`` saturated to the finite
range and reads back ``fp8.float() * scale``; one scale per layer for K and one for V. Other cache
dtypes store values as they are and ignore the scales.
"""

from __future__ import annotations

import torch

from . import torch_impl
from ._checks import check_attention, check_index, check_kv_cache, check_store, value_views_key
from .block_copy import check_block_pairs, swap_blocks_torch
from .cpu_attention import DecodeGather, plan_decode_gather  # noqa: F401 - public: the CPU decode's per-step plan
from .fp8_gemm import fp8_linear  # noqa: F401 - public here like the others (Triton on CUDA, torch elsewhere)
from .int_gemm import int_linear  # noqa: F401 - likewise: int4/int8 group-quantized weights


def store_kv(key, value, k_cache, v_cache, slot_mapping, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write new tokens' K and V into their slots of one layer's pool.

    Parameters
    ----------
    key : [num_tokens, num_kv_heads, head_dim], float16/bfloat16/float32
    value : [num_tokens, num_kv_heads, v_head_dim], or ``None`` with ``v_cache`` ``None``: write the key only
        (a latent cache, whose V is a view of K: the key is the whole latent entry; ``v_scale`` is unused)
    k_cache : [num_blocks, block_size, num_kv_heads, head_dim], any of float16, bfloat16, float32,
        float8_e4m3fn, float8_e5m2; written in place
    v_cache : [num_blocks, block_size, num_kv_heads, v_head_dim <= head_dim] of ``k_cache``'s dtype, or ``None``
    slot_mapping : int64 (or int32) [num_tokens], slot of each token; negative = skip (padding; on CPU under
        torch.compile a negative slot raises instead)
    k_scale, v_scale : per-layer fp8 scales, see the module docstring
    """
    if k_cache.is_cuda:
        from .kv_store import _launch_store_kv

        _launch_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    check_store(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    torch_impl.store_kv_torch(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def paged_decode_attention(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    *,
    scale: float,
    softcap: float = 0.0,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    gather: DecodeGather | None = None,
    cpu_kernel: str = "native",
) -> torch.Tensor:
    """Attention of one new token per request over that request's K/V in the pool.

    Parameters
    ----------
    query : [num_requests, num_q_heads, head_dim], float16/bfloat16/float32; request b's token is at
        position ``seq_lens[b] - 1``. ``num_q_heads`` is a multiple of ``num_kv_heads`` (GQA/MQA).
    k_cache : [num_blocks, block_size, num_kv_heads, head_dim], any cache dtype
    v_cache : [num_blocks, block_size, num_kv_heads, v_head_dim <= head_dim], ``k_cache``'s dtype; may be the
        view ``k_cache[..., :v_head_dim]`` (a latent cache, see the module docstring; then pass
        ``v_scale == k_scale`` for fp8)
    block_tables : int32 [num_requests, max_blocks]
    seq_lens : int32 [num_requests], tokens in the pool per request, the current one included
    scale : softmax scale, usually ``head_dim ** -0.5``
    softcap : > 0 caps scores as ``softcap * tanh(scores / softcap)`` (Gemma 2); 0 disables it
    sliding_window : ``w`` attends to the last ``w`` positions only (key position > query position - w)
    k_scale, v_scale : fp8 scales, see the module docstring
    out : optional [num_requests, num_q_heads, v_head_dim] float output buffer
    sinks : optional [num_q_heads] float, one learned logit per query head (gpt-oss attention sinks): it
        joins each softmax denominator as a score without a value, so outputs shrink by
        ``sum(exp(s)) / (sum(exp(s)) + exp(sink))``
    alibi_slopes : optional contiguous float32 [num_q_heads], ALiBi (Bloom, MPT): query head ``h`` adds
        ``alibi_slopes[h] * (key_position - query_position)`` to its scores (after scaling and soft-capping).
        ``None`` costs nothing. On CPU it takes the torch per-KV-head path (not the native or compiled kernel)
    gather : CPU only, optional: the step's :func:`plan_decode_gather` for these block tables, lengths and
        window, shared by every layer of the step (built per call when omitted); ignored on CUDA
    cpu_kernel : CPU only: ``"native"`` (default) runs the C++ kernel of :mod:`.cpu_native` (built at the
        first call; reads the blocks in place); ``"compiled"`` the no-gather kernel compiled by inductor
        (:mod:`.cpu_decode`; compiled at the first call); ``"sdpa"`` gathers and calls SDPA. A kernel
        that cannot build here falls back to the next one; under ``torch.compile`` the compiled math is
        traced. ``gather`` is only used by the SDPA path (and built when omitted). Ignored on CUDA

    Returns
    -------
    [num_requests, num_q_heads, v_head_dim] in ``query``'s dtype (or ``out``). On CUDA, long contexts
    with few requests use split-K (flash-decoding), chosen from shapes without a device sync.
    """
    if query.is_cuda:
        from .paged_decode import _launch_paged_decode

        return _launch_paged_decode(
            query, k_cache, v_cache, block_tables, seq_lens,
            scale=scale, softcap=softcap, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, out=out,
            sinks=sinks, alibi_slopes=alibi_slopes,
        )  # fmt: skip
    check_attention(
        query, k_cache, v_cache, block_tables,
        softcap=softcap, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, out=out, sinks=sinks,
        alibi_slopes=alibi_slopes,
    )  # fmt: skip
    check_index("seq_lens", seq_lens, (query.shape[0],), query.device)
    return torch_impl.paged_decode_attention_torch(
        query, k_cache, v_cache, block_tables, seq_lens,
        scale=scale, softcap=softcap, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, out=out,
        sinks=sinks, alibi_slopes=alibi_slopes, gather=gather, cpu_kernel=cpu_kernel,
    )  # fmt: skip


def paged_prefill_attention(
    query,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    *,
    scale: float,
    softcap: float = 0.0,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    attend_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of many requests' new tokens (packed) over their cached prefix and themselves.

    Serves prefill, chunked prefill, prefix-cache hits and recompute alike: the new tokens' K/V are
    already stored, so every position ``< seq_lens[b]`` of request b is in the pool.

    Parameters
    ----------
    query : [num_tokens, num_q_heads, head_dim], float16/bfloat16/float32; request b's queries are
        rows ``query_start_loc[b]:query_start_loc[b+1]``, at positions
        ``seq_lens[b] - q_len .. seq_lens[b] - 1``
    k_cache, v_cache : as for ``paged_decode_attention`` (V may be narrower, a view of K)
    block_tables : int32 [num_requests, max_blocks]
    query_start_loc : int32 [num_requests + 1], rising from 0 to num_tokens
    seq_lens : int32 [num_requests], cached prefix + new tokens
    scale, softcap, sliding_window, k_scale, v_scale, out, sinks, alibi_slopes : as for ``paged_decode_attention``
    new_kv : CPU only, optional: the new tokens' K and V (``[num_tokens, num_kv_heads, head_dim]``, V
        ``v_head_dim`` wide, as just stored). A request with no cached prefix then attends over them directly,
        without reading the pool back (the pool holds the same values when its dtype is theirs; otherwise it is
        read). Ignored on CUDA
    attend_limits : optional int32/int64 [num_tokens]: the last key position each query row sees, from its own
        position to its request's ``seq_len - 1`` (bidirectional spans: a token of an image, or of a prefix-LM
        prompt, sees the whole span, whose K/V this step or an earlier one stored); the sliding window still
        counts back from the row's own position. ``None``: every row its own position (causal)

    Returns
    -------
    [num_tokens, num_q_heads, v_head_dim] in ``query``'s dtype (or ``out``).
    """
    if attend_limits is not None:
        check_index("attend_limits", attend_limits, (query.shape[0],), query.device)
    if query.is_cuda:
        from .paged_prefill import _launch_paged_prefill

        return _launch_paged_prefill(
            query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
            scale=scale, softcap=softcap, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, out=out,
            sinks=sinks, alibi_slopes=alibi_slopes, attend_limits=attend_limits,
        )  # fmt: skip
    check_attention(
        query, k_cache, v_cache, block_tables,
        softcap=softcap, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, out=out, sinks=sinks,
        alibi_slopes=alibi_slopes,
    )  # fmt: skip
    check_index("seq_lens", seq_lens, (block_tables.shape[0],), query.device)
    check_index("query_start_loc", query_start_loc, (block_tables.shape[0] + 1,), query.device)
    return torch_impl.paged_prefill_attention_torch(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        scale=scale, softcap=softcap, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale, out=out,
        sinks=sinks, alibi_slopes=alibi_slopes, new_kv=new_kv, attend_limits=attend_limits,
    )  # fmt: skip


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Copy-on-write inside the pool: block ``src[i]`` -> block ``dst[i]`` in every layer's K and V.

    Parameters
    ----------
    k_caches, v_caches : per layer, [num_blocks, block_size, num_kv_heads, head_dim] (V: ``v_head_dim``); a
        latent layer's V, the view ``k_cache[..., :v_head_dim]``, is copied with its K (its pool once more)
    src, dst : int [num_pairs] block ids (moved to the pool's device if needed); ``dst`` distinct
        and disjoint from ``src``
    """
    if not k_caches:
        return
    # A V view of K has no whole blocks of its own to copy (the Triton copy needs them): copy K in its place.
    v_caches = [k if value_views_key(k, v) else v for k, v in zip(k_caches, v_caches, strict=True)]
    device = k_caches[0].device
    src, dst = src.to(device), dst.to(device)
    if device.type == "cuda":
        from .block_copy import _launch_copy_blocks

        _launch_copy_blocks(k_caches, v_caches, src, dst)
        return
    for k_cache, v_cache in zip(k_caches, v_caches, strict=True):
        check_kv_cache(k_cache, v_cache)
    check_block_pairs(src, dst, device, device)
    torch_impl.copy_blocks_torch(k_caches, v_caches, src, dst)


def swap_blocks(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], src_ids, dst_ids) -> None:
    """Copy whole blocks between the pool and the CPU swap space (either way), all layers, batched.

    Parameters
    ----------
    src_caches, dst_caches : matching lists (K and V pools of every layer, in any fixed order) of
        [num_blocks, block_size, num_kv_heads, head_dim]; the swap space should be pinned CPU memory
        when the pool is on CUDA
    src_ids, dst_ids : int [num_pairs]: block ``src_ids[i]`` of each source -> ``dst_ids[i]`` of its destination
    """
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"{len(src_caches)} source pools but {len(dst_caches)} destination pools")
    if not src_caches or src_ids.numel() == 0:
        return
    for src, dst in zip(src_caches, dst_caches):
        if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
            raise ValueError(f"pool blocks differ: {src.dtype} {tuple(src.shape)} vs {dst.dtype} {tuple(dst.shape)}")
    check_block_pairs(src_ids, dst_ids, src_ids.device, dst_ids.device)
    swap_blocks_torch(src_caches, dst_caches, src_ids, dst_ids)
