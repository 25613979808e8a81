"""Argument checks shared by the public functions, the Triton launchers and the plain-torch paths.

Every check here reads only shapes, dtypes, devices and strides, never tensor values, so none of
them synchronises a CUDA stream. Checks that need values (``seq_lens`` against the block table) are
done by the plain-torch paths only, where reading values is free.

User-facing mistakes raise ``ValueError`` naming the bad argument (``assert`` would vanish under
``python -O``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_DTYPES = QUERY_DTYPES + FP8_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the fp8 cache dtypes, the only ones whose values carry a scale."""
    return dtype in FP8_DTYPES


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (>= 1); Triton block shapes must be powers of two."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    """Dimensions of one layer's K/V pool: K ``[num_blocks, block_size, num_kv_heads, head_dim]``, V the same
    with ``v_head_dim`` (``<= head_dim``; smaller for a latent cache, whose V is a view of K's first columns)."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """Dimensions of one attention call: the pool's plus the query side's."""

    cache: KVCacheShape
    num_rows: int
    """Decode: requests (one query token each). Prefill: query tokens of all requests, packed."""
    num_q_heads: int

    @property
    def queries_per_kv(self) -> int:
        """Query heads sharing one KV head (1: MHA, > 1: GQA, num_q_heads: MQA)."""
        return self.num_q_heads // self.cache.num_kv_heads


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> KVCacheShape:
    """Check one layer's K and V pools agree and return their dimensions.

    V may be narrower than K (``v_head_dim <= head_dim``): a latent (MLA) cache's V is ``k_cache[..., :v_head_dim]``.
    """
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] and [..., v_head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if v_cache.shape[3] > k_cache.shape[3]:
        raise ValueError(f"v_cache's head_dim {v_cache.shape[3]} exceeds k_cache's {k_cache.shape[3]}")
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"KV cache dtype must be one of {KV_DTYPES} (K and V alike), got {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache is on {k_cache.device} but v_cache is on {v_cache.device}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return KVCacheShape(num_blocks, block_size, num_kv_heads, head_dim, v_head_dim=v_cache.shape[3])


def value_views_key(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``v_cache`` is ``k_cache[..., :v_head_dim]`` (a latent cache: V is the first columns of K's entries).

    Equal widths are never a latent cache (no pointer is compared for them), and under ``torch.compile`` the
    answer is ``False`` (a pointer comparison breaks the graph; reading V on its own is as correct, if slower)."""
    return (
        v_cache.shape[3] < k_cache.shape[3]
        and v_cache.shape[:3] == k_cache.shape[:3]
        and v_cache.dtype == k_cache.dtype
        and v_cache.stride() == k_cache.stride()
        and not torch.compiler.is_compiling()
        and v_cache.data_ptr() == k_cache.data_ptr()
    )


def check_index(name: str, tensor: torch.Tensor, shape: tuple[int, ...] | None, device: torch.device) -> None:
    """Check an index tensor (slots, block tables, lengths): int32/int64, on ``device``, of ``shape``."""
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device}")
    if shape is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def check_scales(k_scale: float, v_scale: float) -> None:
    """Scales are Python numbers (a CUDA scalar tensor would force a sync to read) and positive."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive Python float, got {value!r}")


def check_store(key, value, k_cache, v_cache, slot_mapping, *, k_scale: float, v_scale: float) -> KVCacheShape:
    """Checks for ``store_kv``: new K/V rows match the pool's heads and head widths, one slot per row.

    ``value`` and ``v_cache`` are both ``None`` for a key-only store (a latent cache: V is a view of K)."""
    if (value is None) != (v_cache is None):
        raise ValueError("value and v_cache must be given together, or both None (a key-only store)")
    cache = check_kv_cache(k_cache, k_cache if v_cache is None else v_cache)
    rows = slot_mapping.shape[0]
    expected = {
        "key": (rows, cache.num_kv_heads, cache.head_dim),
        "value": (rows, cache.num_kv_heads, cache.v_head_dim),
    }
    for name, tensor in (("key", key), ("value", value)):
        if tensor is None:
            continue
        if tuple(tensor.shape) != expected[name] or tensor.dtype not in QUERY_DTYPES or tensor.device != k_cache.device:
            raise ValueError(
                f"{name} must be a float16/bfloat16/float32 tensor of shape {expected[name]} (num_tokens from "
                f"slot_mapping) on {k_cache.device}, got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
            )
    check_index("slot_mapping", slot_mapping, (rows,), k_cache.device)
    check_scales(k_scale, v_scale)
    return cache


def check_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    softcap: float,
    sliding_window: int | None,
    k_scale: float,
    v_scale: float,
    out: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> AttentionShape:
    """Checks common to decode and prefill; returns the call's dimensions."""
    cache = check_kv_cache(k_cache, v_cache)
    if query.dim() != 3 or query.shape[2] != cache.head_dim:
        raise ValueError(f"query must be [rows, num_q_heads, {cache.head_dim}], got {tuple(query.shape)}")
    if query.dtype not in QUERY_DTYPES:
        raise ValueError(f"query dtype must be one of {QUERY_DTYPES}, got {query.dtype}")
    if query.device != k_cache.device:
        raise ValueError(f"query is on {query.device} but the KV cache is on {k_cache.device}")
    num_q_heads = query.shape[1]
    if num_q_heads % cache.num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({cache.num_kv_heads})")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_requests, max_blocks], got {tuple(block_tables.shape)}")
    check_index("block_tables", block_tables, None, query.device)
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    check_scales(k_scale, v_scale)
    check_sinks(sinks, num_q_heads, query.device)
    check_alibi_slopes(alibi_slopes, num_q_heads, query.device)
    out_shape = (*query.shape[:2], cache.v_head_dim)
    if out is not None and (out.shape != out_shape or out.device != query.device or out.dtype not in QUERY_DTYPES):
        raise ValueError(
            f"out must be a float16/bfloat16/float32 tensor of shape {out_shape} on {query.device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return AttentionShape(cache=cache, num_rows=query.shape[0], num_q_heads=num_q_heads)


def check_sinks(sinks: torch.Tensor | None, num_q_heads: int, device: torch.device) -> None:
    """Attention sinks: ``None``, or one float logit per query head, contiguous, on the query's device."""
    if sinks is None:
        return
    if (tuple(sinks.shape) != (num_q_heads,) or sinks.dtype not in QUERY_DTYPES or sinks.device != device
            or not sinks.is_contiguous()):  # fmt: skip
        raise ValueError(
            f"sinks must be a contiguous float16/bfloat16/float32 tensor of shape ({num_q_heads},) (one logit per "
            f"query head) on {device}, got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
        )


def check_alibi_slopes(alibi_slopes: torch.Tensor | None, num_q_heads: int, device: torch.device) -> None:
    """ALiBi slopes: ``None``, or one fp32 slope per query head, contiguous, on the query's device."""
    if alibi_slopes is None:
        return
    if (tuple(alibi_slopes.shape) != (num_q_heads,) or alibi_slopes.dtype != torch.float32
            or alibi_slopes.device != device or not alibi_slopes.is_contiguous()):  # fmt: skip
        raise ValueError(
            f"alibi_slopes must be a contiguous float32 tensor of shape ({num_q_heads},) (one slope per query "
            f"head) on {device}, got {alibi_slopes.dtype} {tuple(alibi_slopes.shape)} on {alibi_slopes.device}"
        )


def check_unit_inner_stride(**tensors: torch.Tensor) -> None:
    """Triton path: the head_dim axis must be contiguous so each row is one coalesced load.

    Other strides are free (caches may be views of a ``[num_blocks, 2, ...]`` tensor, the query a
    slice of a fused QKV output). A non-unit inner stride almost always means an accidental transpose.
    """
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dimension, got strides {tensor.stride()}")
