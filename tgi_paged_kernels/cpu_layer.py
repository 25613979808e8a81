"""A Llama-form decoder layer's decode step as one native call (``csrc/cpu_layer.cpp``), with its torch references.

On a small model a decode step is host time: per layer transformers' modules and our fused blocks still
make ~10 calls (two norms, four GEMMs, RoPE, the KV store, the attention, SiLU-and-mul, two residual
adds), each with its Python, dispatch and OpenMP fork. :func:`llama_decode_layer` runs all of it in one
call and one OpenMP region, on weights packed once (:func:`pack_weight`) for a GEMM whose every output is
one sequential sum of fused multiply-adds (the same on AVX-512, AVX2 and scalar code, whatever the rows
or threads). fp32 only, fp32 pools; the caller (``runner.cpu.native_layers``) decides when it applies.

References (the specification; ``tests/kernels/test_cpu_layer.py`` compares them with the kernels):
:func:`gemm_packed_ref`, :func:`llama_decode_layer_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cpu_decode import decode_attention_math
from .cpu_native import NativeKernels

PACK_BLOCK = 16
"""Columns per packed block (``kNB`` in the C++)."""


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 ``[N, K]`` weight as ``[ceil(N / 16), K, 16]`` (columns zero-padded), the GEMM's layout."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"pack_weight: needs an fp32 [N, K] weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    padded = torch.zeros((-(-n // PACK_BLOCK) * PACK_BLOCK, k), dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(-1, PACK_BLOCK, k).transpose(1, 2).contiguous()


def gemm_packed(
    native: NativeKernels, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for fp32 ``x`` ``[M, K]`` (rows contiguous) and ``W`` packed by :func:`pack_weight`."""
    m, k = x.shape
    if (
        x.dtype != torch.float32
        or x.stride(-1) != 1
        or packed.dtype != torch.float32
        or not packed.is_contiguous()
        or packed.dim() != 3
        or packed.shape[1:] != (k, PACK_BLOCK)
        or packed.shape[0] * PACK_BLOCK < n
        or (bias is not None and (bias.dtype != torch.float32 or bias.numel() < n or not bias.is_contiguous()))
    ):
        raise ValueError(f"gemm_packed: x {tuple(x.shape)} {x.dtype} does not fit a packed {tuple(packed.shape)}")
    out = torch.empty((m, n), dtype=torch.float32)
    native.gemm_packed(
        x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), n, None if bias is None else bias.data_ptr(), None, 0,
        out.data_ptr(), n, torch.get_num_threads(),
    )  # fmt: skip
    return out


def gemm_packed_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`gemm_packed` on the unpacked ``[N, K]`` weight: each output summed over ``k`` in
    order with fused multiply-adds, in float64 (the kernel's fp32 result lies within a few ulp of it)."""
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).float()


@dataclass(frozen=True, slots=True)
class LlamaLayerWeights:
    """One Llama-form decoder layer, packed for :func:`llama_decode_layer` (fp32 CPU tensors)."""

    ln1: torch.Tensor
    eps1: float
    ln2: torch.Tensor
    eps2: float
    qkv: torch.Tensor
    """Packed ``[(Hq + 2 Hkv) D, H]``: query, key and value heads in order."""
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    """Packed ``[2 I, H]``, gate rows first."""
    down: torch.Tensor
    hidden_size: int
    intermediate: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int
    """Sliding window in positions, 0 for full attention."""

    def scratch_floats(self, tokens: int) -> int:
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        return tokens * (self.hidden_size + (2 * hq + 3 * hkv) * d + hq * d + 3 * self.intermediate)


def llama_decode_layer(
    native: NativeKernels,
    w: LlamaLayerWeights,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor | None:
    """The layer's output for fp32 ``hidden`` ``[T, H]`` (one token of each of ``T`` requests; a new tensor),
    writing the tokens' K/V into fp32 pools ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping`` (int64;
    negative slots skipped).

    ``cos``/``sin`` ``[T, D]`` fp32 contiguous; ``block_tables`` ``[T, *]`` and ``seq_lens`` ``[T]``, int32
    or int64. ``None`` for inputs of another kind (the caller runs the per-op path); ``ValueError`` for a
    slot or block id outside the pool or a table too narrow (as the single kernels do).
    """
    tokens = hidden.shape[0]
    d = w.head_dim
    if (
        hidden.dtype != torch.float32
        or hidden.shape != (tokens, w.hidden_size)
        or k_cache.dtype != torch.float32
        or k_cache.shape != v_cache.shape
        or k_cache.stride() != v_cache.stride()
        or k_cache.shape[2:] != (w.num_kv_heads, d)
        or k_cache.stride(-1) != 1
        or cos.shape != (tokens, d)
        or sin.shape != (tokens, d)
        or not (cos.is_contiguous() and sin.is_contiguous())
        or cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or slot_mapping.dtype != torch.int64
        or slot_mapping.numel() != tokens
        or block_tables.dim() != 2
        or block_tables.shape[0] < tokens
        or seq_lens.numel() < tokens
        or block_tables.dtype not in (torch.int32, torch.int64)
        or seq_lens.dtype not in (torch.int32, torch.int64)
    ):
        return None
    out = hidden.contiguous().clone()
    slot_mapping, seq_lens = slot_mapping.contiguous(), seq_lens.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    scratch = torch.empty(w.scratch_floats(tokens), dtype=torch.float32)
    block_size = k_cache.shape[1]
    status = native.llama_decode_layer(
        out.data_ptr(), tokens, w.hidden_size, w.intermediate,
        w.ln1.data_ptr(), w.eps1, w.ln2.data_ptr(), w.eps2,
        w.qkv.data_ptr(), None if w.qkv_bias is None else w.qkv_bias.data_ptr(), w.o.data_ptr(),
        w.gate_up.data_ptr(), w.down.data_ptr(),
        cos.data_ptr(), sin.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2),
        slot_mapping.data_ptr(), block_tables.data_ptr(), int(block_tables.dtype == torch.int64),
        block_tables.stride(0), block_tables.shape[1], seq_lens.data_ptr(), int(seq_lens.dtype == torch.int64),
        w.num_q_heads, w.num_kv_heads, d, block_size, w.scale, w.window,
        scratch.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status == 5:
        raise ValueError(
            f"llama_decode_layer: slot_mapping holds a slot outside the pool's {k_cache.shape[0] * block_size} slots"
        )
    if status != 0:
        raise ValueError(native.decode_error(status, block_tables, seq_lens, block_size, k_cache.shape[0]))
    return out


def llama_decode_layer_ref(
    weights: dict[str, torch.Tensor | None],
    w: LlamaLayerWeights,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """Reference of :func:`llama_decode_layer` in torch ops, on the unpacked ``weights`` (``qkv``,
    ``qkv_bias``, ``o``, ``gate_up``, ``down``, as ``[N, K]``): transformers' Llama decoder layer over the
    paged pools (same arguments otherwise; writes the pools too)."""
    tokens, hq, hkv, d = hidden.shape[0], w.num_q_heads, w.num_kv_heads, w.head_dim

    def linear(x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = weights[name]
        assert weight is not None
        return F.linear(x, weight, bias)

    x = F.rms_norm(hidden, (w.hidden_size,), w.ln1, w.eps1)
    qkv = linear(x, "qkv", weights.get("qkv_bias")).view(tokens, hq + 2 * hkv, d)
    half = d // 2
    qk = qkv[:, : hq + hkv]
    qk = qk * cos[:, None] + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin[:, None]
    k, v = qk[:, hq:], qkv[:, hq + hkv :]
    block_size, keep = k_cache.shape[1], slot_mapping >= 0  # negative slots: nothing written
    blocks, offsets = slot_mapping[keep] // block_size, slot_mapping[keep] % block_size
    k_cache[blocks, offsets] = k[keep]
    v_cache[blocks, offsets] = v[keep]
    attn = decode_attention_math(
        qk[:, :hq], k_cache, v_cache, block_tables.long(), seq_lens, w.scale, 0.0, w.window or None, None, 1.0, 1.0
    )
    hidden = hidden + linear(attn.reshape(tokens, hq * d), "o")
    x = F.rms_norm(hidden, (w.hidden_size,), w.ln2, w.eps2)
    gate, up = linear(x, "gate_up").chunk(2, dim=-1)
    return hidden + linear(F.silu(gate) * up, "down")
