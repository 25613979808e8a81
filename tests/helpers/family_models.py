"""Tiny random configs of the decoder families TGI users serve, for the family matrix.

:data:`FAMILIES` lists every family of issue 15 with the transformers ``model_type`` and the
overrides that make it tiny (2 layers, hidden 32-64, a 512-token vocabulary, the feature the family
brings turned on at a size the test reaches: windows of 8 tokens, soft-capping, MoE routing, MQA,
partial rotary, learned positions, attention sinks). :func:`write_family_model` writes one to disk
with the tiny BPE tokenizer of :mod:`tests.helpers.tiny_models`.

A family whose ``model_type`` this transformers lacks is reported as missing, not faked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transformers

from tests.helpers.tiny_models import BOS_ID, EOS_ID, PAD_ID, write_model_from_config

_TOKENS = dict(vocab_size=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
_LLAMA_LIKE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
_WINDOW = 8  # shorter than every prompt + output of the matrix, so the window really cuts


@dataclass(frozen=True)
class Family:
    """One row of the matrix: a family, how to make it tiny, and what it exercises."""

    name: str
    model_type: str
    overrides: dict[str, Any]
    feature: str
    """What the paged path must honour for this family (the docs' notes column)."""
    param_std: dict[str, float] = field(default_factory=dict)
    """Parameter-name suffix -> std of its random draw, for weights whose effect must be visible."""


FAMILIES: tuple[Family, ...] = (
    Family("Llama", "llama", dict(_LLAMA_LIKE), "GQA, RoPE"),
    Family(
        "Llama-3.1",
        "llama",
        dict(
            _LLAMA_LIKE,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        "rope_scaling llama3",
    ),
    Family("Mistral", "mistral", dict(_LLAMA_LIKE, sliding_window=_WINDOW), "sliding window (every layer)"),
    Family(
        "Mixtral",
        "mixtral",
        dict(_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2, sliding_window=_WINDOW),
        "MoE, sliding window",
    ),
    Family("Qwen2", "qwen2", dict(_LLAMA_LIKE), "q/k/v biases"),
    Family(
        "Qwen2-MoE",
        "qwen2_moe",
        dict(
            _LLAMA_LIKE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
        "MoE with shared expert",
    ),
    Family("Qwen3", "qwen3", dict(_LLAMA_LIKE, head_dim=32), "q/k norm, head_dim != hidden/heads"),
    Family(
        "Qwen3-MoE",
        "qwen3_moe",
        dict(_LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        "MoE, q/k norm",
    ),
    Family(
        "Gemma",
        "gemma",
        dict(_LLAMA_LIKE, head_dim=16, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
        "scaled embeddings, GeGLU",
    ),
    Family(
        "Gemma2",
        "gemma2",
        dict(
            _LLAMA_LIKE,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=_WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
            initializer_range=0.1,
        ),
        "logit soft-capping, alternating sliding/full layers",
    ),
    Family(
        "Gemma3",
        "gemma3_text",
        dict(
            _LLAMA_LIKE,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=True,
            initializer_range=0.1,
        ),
        "sliding/global layers, q/k norm, local RoPE base",
    ),
    Family(
        "Phi",
        "phi",
        dict(_LLAMA_LIKE, num_key_value_heads=4, partial_rotary_factor=0.5),
        "parallel residual, partial rotary, LayerNorm",
    ),
    Family("Phi3", "phi3", dict(_LLAMA_LIKE, sliding_window=_WINDOW), "fused qkv and gate_up, sliding window"),
    Family(
        "Granite",
        "granite",
        dict(
            _LLAMA_LIKE, attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0
        ),
        "attention multiplier",
    ),
    Family(
        "Cohere",
        "cohere",
        dict(_LLAMA_LIKE, logit_scale=0.5, tie_word_embeddings=True),
        "parallel residual, LayerNorm, interleaved RoPE",
    ),
    Family(
        "Cohere2",
        "cohere2",
        dict(
            _LLAMA_LIKE,
            logit_scale=0.5,
            tie_word_embeddings=True,
            sliding_window=_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "sliding/full layers, parallel residual, LayerNorm",
    ),
    Family(
        "StarCoder2",
        "starcoder2",
        dict(_LLAMA_LIKE, sliding_window=_WINDOW, initializer_range=0.4),
        "sliding window, biases",
    ),
    Family(
        "GPT-BigCode",
        "gpt_bigcode",
        dict(n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=256, multi_query=True, initializer_range=0.2),
        "multi-query attention",
    ),
    Family(
        "GPT-NeoX",
        "gpt_neox",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            rotary_pct=0.25,
            use_parallel_residual=True,
            attention_bias=False,
            initializer_range=0.2,
        ),
        "parallel residual, partial rotary",
    ),
    Family(
        "GPT-J",
        "gptj",
        dict(n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=256, rotary_dim=8, initializer_range=0.2),
        "parallel residual, partial interleaved rotary",
    ),
    Family(
        "Falcon",
        "falcon",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            max_position_embeddings=256,
            initializer_range=0.2,
        ),
        "new decoder architecture",
    ),
    Family(
        "Falcon-7B",
        "falcon",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=False,
            multi_query=True,
            parallel_attn=True,
            max_position_embeddings=256,
            initializer_range=0.2,
        ),
        "old architecture, multi-query, parallel attention",
    ),
    Family(
        "Falcon-RW",
        "falcon",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=False,
            multi_query=False,
            parallel_attn=False,
            alibi=True,
            bias=True,
            max_position_embeddings=256,
            initializer_range=0.3,
        ),
        "ALiBi, serial attention",
        # LayerNorm biases near 0, not 1: varied greedy tokens that change when the ALiBi bias is halved,
        # doubled or dropped (at 0.2 and unit biases the tiny model repeats one or two tokens)
        param_std={"layernorm.bias": 0.1},
    ),
    Family(
        "OPT",
        "opt",
        dict(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=256,
            init_std=0.2,
        ),
        "learned positions",
    ),
    Family(
        "GPT-2",
        "gpt2",
        dict(n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2),
        "learned positions, Conv1D",
    ),
    Family("OLMo2", "olmo2", dict(_LLAMA_LIKE), "post-norm, q/k norm"),
    Family(
        "gpt-oss",
        "gpt_oss",
        dict(
            _LLAMA_LIKE,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "attention sinks, alternating sliding/full layers, MoE",
        param_std={"sinks": 2.0},
    ),
    Family(
        "Bloom",
        "bloom",
        dict(hidden_size=64, n_layer=2, n_head=4, initializer_range=0.5, tie_word_embeddings=False),
        "ALiBi, fused per-head q/k/v, embedding LayerNorm",
        param_std={"layernorm.bias": 0.1},  # LayerNorm biases near 0, not 1: varied greedy tokens
    ),
    Family(
        "MPT",
        "mpt",
        # Untied: with the LM head tied to these random embeddings, EOS wins some greedy steps, which HF's
        # reference (min_new_tokens) suppresses and the requests (EOS ignored) take.
        dict(
            d_model=64,
            n_layers=2,
            n_heads=4,
            max_seq_len=256,
            expansion_ratio=2,
            initializer_range=0.5,
            tie_word_embeddings=False,
        ),
        "ALiBi, fused q/k/v, no biases",
    ),
    Family(
        "DeepSeek-V2",
        "deepseek_v2",
        dict(
            _LLAMA_LIKE,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
        ),
        "multi-head latent attention (latent paged), shared experts, group-limited top-k, first layer dense",
    ),
    Family(
        "DeepSeek-V3",
        "deepseek_v3",
        dict(
            _LLAMA_LIKE,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_group=2,
            topk_group=1,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        ),
        "multi-head latent attention (latent paged), q LoRA, interleaved RoPE, yarn mscale, grouped top-k with "
        "correction bias, shared experts, first layer dense",
        param_std={"e_score_correction_bias": 0.2},
    ),
)
"""The issue's families, in the issue's order, then the stretch ones."""

FAMILY_BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}


def is_available(family: Family) -> bool:
    """Whether the installed transformers knows the family's ``model_type``."""
    return family.model_type in transformers.CONFIG_MAPPING


def family_config(family: Family) -> transformers.PretrainedConfig:
    """The tiny config of ``family`` (``KeyError`` when transformers lacks the model type)."""
    return transformers.AutoConfig.for_model(family.model_type, **{**_TOKENS, **family.overrides})


def write_family_model(family: Family, path: Path | str, *, seed: int = 0) -> Path:
    """Write ``family``'s tiny random model plus the tiny tokenizer to ``path`` and return it."""
    return write_model_from_config(family_config(family), path, seed=seed, param_std=family.param_std)


def num_kv_groups(model_dir: Path | str) -> int:
    """The KV layer groups the shard makes of the model in ``model_dir`` (``ModelSpec.kv_groups``; a Medusa
    checkpoint: its base model's). A block of a grouped pool holds ``1 / groups`` of the layers, so the same
    memory is ``groups`` times the blocks."""
    import torch

    from tgi_paged_backend.runner.model.spec import ModelSpec

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if "medusa_num_heads" in raw:
        model_dir = raw["base_model_name_or_path"]
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return ModelSpec.from_hf_config(config, torch.float32).kv_groups.num_groups
