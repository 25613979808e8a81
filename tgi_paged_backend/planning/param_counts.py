"""Parameters of a decoder-only model from its config, whole and per tensor-parallel rank.

What one rank of ``--num-shard N`` holds is what :mod:`tgi_paged_backend.runner.parallel.slicing` leaves it:

- split over the ranks: query heads (q rows, their biases, gpt-oss's sinks), the output projection's input
  columns, the MLP's intermediate dimension, every expert's intermediate dimension and a shared expert's;
- K/V projections: ``Hkv / N`` heads, or the one head a rank's queries read when ``Hkv < N`` (replicated);
- whole on every rank: embeddings, the output head, norms (per-head q/k norms too), routers, the output
  projections' biases, a shared expert's gate.

Multi-head latent attention (DeepSeek-V2/V3, ``kv_lora_rank``): the query path and ``kv_b_proj``/``o_proj`` split by
heads, the latent's projection and norm whole (:func:`latent_attention_params`); DeepSeek's MoE: routed and shared
experts, dense first layers.

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
    return int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)


def _is_sparse_layer(cfg: dict[str, Any], layer: int) -> bool:
    """Qwen-MoE keeps a dense MLP on ``mlp_only_layers`` and off the ``decoder_sparse_step`` grid; DeepSeek on its
    ``first_k_dense_replace`` first layers and off the ``moe_layer_freq`` grid."""
    if _num_experts(cfg) == 0 or layer in (cfg.get("mlp_only_layers") or ()):
        return False
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:
        return layer >= int(cfg.get("first_k_dense_replace") or 0) and layer % int(cfg.get("moe_layer_freq") or 1) == 0
    step = int(cfg.get("decoder_sparse_step") or 1)
    return (layer + 1) % step == 0


def latent_attention_params(cfg: dict[str, Any], n: int) -> int:
    """One layer's multi-head latent attention (DeepSeek-V2/V3) on one rank of ``n``: the query (``q_proj``, or
    ``q_a_proj`` + its norm + ``q_b_proj``), ``kv_a_proj_with_mqa`` + its norm (whole on every rank: the latent is
    replicated), ``kv_b_proj`` and ``o_proj`` split by heads, biases where ``attention_bias``."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]) // n
    rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    nope, v = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
    q_rank = int(cfg.get("q_lora_rank") or 0)
    bias = bool(cfg.get("attention_bias", False))
    query = hidden * q_rank + q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
    latent = hidden * (rank + rope) + rank + (rank + rope if bias else 0) + (q_rank if bias else 0)
    return query + latent + rank * heads * (nope + v) + heads * v * hidden + (hidden if bias else 0)


def _shared_experts(cfg: dict[str, Any], hidden: int, n: int) -> int:
    """A layer's shared expert(s): Qwen-MoE's (with its sigmoid gate) or DeepSeek's ``n_shared_experts``."""
    qwen = int(cfg.get("shared_expert_intermediate_size") or 0) // n
    deepseek = int(cfg.get("n_shared_experts") or 0) * int(cfg.get("moe_intermediate_size") or 0) // n
    return 3 * hidden * qwen + (hidden if qwen else 0) + 3 * hidden * deepseek


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
    if cfg.get("kv_lora_rank"):
        attn = latent_attention_params(cfg, n)

    dense_mlp = 3 * hidden * int(cfg.get("intermediate_size") or 4 * hidden) // n
    experts = _num_experts(cfg)
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0)
    expert_inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 4 * hidden) // n
    one_expert = 3 * hidden * expert_inter
    if model_type == "gpt_oss":  # gate_up bias (split), down bias (whole, added by rank 0 only; held by all)
        one_expert += 2 * expert_inter + hidden
    # gpt-oss: router biases; DeepSeek-V3: the routing correction bias (noaux_tc)
    router = hidden * experts + (experts if model_type in ("gpt_oss", "deepseek_v3") else 0)
    shared = _shared_experts(cfg, hidden, n)

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
