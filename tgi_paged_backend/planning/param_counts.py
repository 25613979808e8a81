"""Parameters of a decoder-only model from its config, whole and per tensor-parallel rank.

What one rank of ``--num-shard N`` holds is what :mod:`tgi_paged_backend.runner.parallel.slicing` leaves it:

- split over the ranks: query heads (q rows, their biases, gpt-oss's sinks), the output projection's input
  columns, the MLP's intermediate dimension, every expert's intermediate dimension and a shared expert's;
- K/V projections: ``Hkv / N`` heads, or the one head a rank's queries read when ``Hkv < N`` (replicated);
- whole on every rank: embeddings, the output head, norms (per-head q/k norms too), routers, the output
  projections' biases, a shared expert's gate.

The dense count is exact for the Llama-style families (the planner test checks it against safetensors
headers of tiny models, MoE families included); layouts it does not model (Gemma's extra norms, fused
GPT-style blocks) are estimates within a few norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_moe"})
"""Model types whose q/k/v projections carry biases without an ``attention_bias`` field."""
QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe"})
"""Model types with a per-head RMSNorm on q and k (``head_dim`` weights each)."""


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameters one rank holds, and those one token's forward multiplies (MoE: routed experts only)."""

    held: int
    active: int


def _num_experts(cfg: dict[str, Any]) -> int:
    return int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)


def _is_sparse_layer(cfg: dict[str, Any], layer: int) -> bool:
    """Qwen-MoE keeps a dense MLP on ``mlp_only_layers`` and off the ``decoder_sparse_step`` grid."""
    if _num_experts(cfg) == 0 or layer in (cfg.get("mlp_only_layers") or ()):
        return False
    step = int(cfg.get("decoder_sparse_step") or 1)
    return (layer + 1) % step == 0


def param_counts(cfg: dict[str, Any], num_shard: int = 1) -> ParamCounts:
    """What rank 0 of ``num_shard`` holds of the model ``cfg`` (``config.json`` fields; text config merged)."""
    n = int(num_shard)
    hidden, layers, vocab = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    model_type = str(cfg.get("model_type", ""))
    attention_bias = bool(cfg.get("attention_bias", False))
    qkv_bias = attention_bias or model_type in QKV_BIAS_TYPES

    q, kv_local = heads * head_dim // n, max(kv_heads // n, 1) * head_dim
    attn = hidden * (q + 2 * kv_local) + q * hidden  # q, k, v rows; o's input columns
    attn += (q + 2 * kv_local) if qkv_bias else 0
    attn += hidden if attention_bias else 0  # o's bias, whole on every rank
    attn += 2 * head_dim if model_type in QK_NORM_TYPES else 0
    attn += heads // n if model_type == "gpt_oss" else 0  # sinks, one per query head

    dense_mlp = 3 * hidden * int(cfg.get("intermediate_size") or 4 * hidden) // n
    experts = _num_experts(cfg)
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0)
    expert_inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 4 * hidden) // n
    one_expert = 3 * hidden * expert_inter
    if model_type == "gpt_oss":  # gate_up bias (split), down bias (whole, added by rank 0 only; held by all)
        one_expert += 2 * expert_inter + hidden
    router = hidden * experts + (experts if model_type == "gpt_oss" else 0)
    shared_inter = int(cfg.get("shared_expert_intermediate_size") or 0) // n
    shared = 3 * hidden * shared_inter + (hidden if shared_inter else 0)  # + its sigmoid gate

    held, active = 0, 0
    for layer in range(layers):
        norms = 2 * hidden
        if _is_sparse_layer(cfg, layer):
            mlp_held = experts * one_expert + router + shared
            mlp_active = top_k * one_expert + router + shared
        else:
            mlp_held = mlp_active = dense_mlp
        held += attn + norms + mlp_held
        active += attn + norms + mlp_active
    embeddings = vocab * hidden
    head = 0 if cfg.get("tie_word_embeddings", False) else vocab * hidden
    whole = embeddings + head + hidden  # + the final norm
    return ParamCounts(held=held + whole, active=active + whole)
