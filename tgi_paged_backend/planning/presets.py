"""The public numbers the planner sizes with: GPUs (memory, bandwidth, FLOPs, PCIe) and the config
fields of a few common models (``--model`` presets)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Device:
    """Memory and rough roofline numbers of one device (vendor figures; dense 16-bit tensor FLOPs)."""

    name: str
    memory_gib: float
    mem_gb_per_s: float
    tflops: float
    swap_gb_per_s: float
    """Host <-> device copy bandwidth for swapping (PCIe)."""


GPUS: dict[str, Device] = {
    "A10G": Device("A10G", 24, 600, 70, 12),
    "L4": Device("L4", 24, 300, 121, 12),
    "A100-40": Device("A100-40", 40, 1555, 312, 25),
    "A100-80": Device("A100-80", 80, 2039, 312, 25),
    "H100": Device("H100", 80, 3350, 989, 50),
    "H200": Device("H200", 141, 4800, 989, 50),
}
"""Nominal memory (torch reports a little less), memory bandwidth, dense 16-bit TFLOPs, PCIe copy rate."""
CPU_DEVICE = Device("cpu", 0, 20, 0.1, 10)
"""CPU: memory is the available RAM (read at plan time); the roofline numbers are rough."""
MEM_EFFICIENCY, FLOP_EFFICIENCY, STEP_OVERHEAD_S = 0.8, 0.5, 0.005


PRESETS: dict[str, dict[str, Any]] = {
    # Public architecture numbers (config.json fields) of a few common models.
    "llama-3-8b": dict(
        model_type="llama",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama-3-70b": dict(
        model_type="llama",
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        hidden_size=8192,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "mistral-7b": dict(
        model_type="mistral",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=32768,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        vocab_size=151936,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    "gpt-oss-120b": dict(
        # Sized in the serving dtype: the published checkpoint's MXFP4 experts are not counted as MXFP4.
        model_type="gpt_oss",
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        hidden_size=2880,
        intermediate_size=2880,
        num_local_experts=128,
        experts_per_token=4,
        attention_bias=True,
        vocab_size=201088,
        max_position_embeddings=131072,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 18,
        tie_word_embeddings=False,
    ),
    "gemma-2-9b": dict(
        # Its config.json lists no layer_types: transformers alternates sliding (4096) and full layers.
        model_type="gemma2",
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        hidden_size=3584,
        intermediate_size=14336,
        vocab_size=256000,
        max_position_embeddings=8192,
        sliding_window=4096,
        layer_types=["sliding_attention", "full_attention"] * 21,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=256,
        tie_word_embeddings=True,
    ),
    "deepseek-v3": dict(
        # Multi-head latent attention: the pool holds kv_lora_rank + qk_rope_head_dim = 576 values per token and
        # layer (no K and V per head). Sized in the serving dtype: the published FP8 block-quantized weights are
        # not counted as FP8. The multi-token-prediction layer (num_nextn_predict_layers) is not served.
        model_type="deepseek_v3",
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        moe_layer_freq=1,
        n_group=8,
        topk_group=4,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        vocab_size=129280,
        max_position_embeddings=163840,
        tie_word_embeddings=False,
    ),
    "kimi-k2": dict(
        # DeepSeek-V3's architecture (its checkpoint names model_type kimi_k2 and ships its own code; the sizes
        # are what matter here): 64 heads, 384 routed experts, one dense layer, the same 576-wide latent.
        model_type="deepseek_v3",
        num_hidden_layers=61,
        num_attention_heads=64,
        num_key_value_heads=64,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=384,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        vocab_size=163840,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        intermediate_size=1536,
        vocab_size=49152,
        head_dim=64,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}


def find_device(name: str) -> Device:
    """The device ``--gpu`` names: a key of :data:`GPUS` (any case), or ``cpu``."""
    if name.lower() == "cpu":
        return CPU_DEVICE
    key = {k.lower(): k for k in GPUS}.get(name.lower())
    if key is None:
        raise ValueError(f"--gpu {name!r} is unknown: allowed {', '.join(GPUS)}, cpu (or give --memory-gb)")
    return GPUS[key]
