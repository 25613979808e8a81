"""The layer forms of the host-bound model (``--hostbound-forms``): the same tiny shape in each family's form.

Each form keeps :class:`~integration.peers.hostbound.HostBoundSpec`'s shape (30 layers, hidden 128, head_dim 64,
2 query heads and 1 KV head, MLP 256) and changes only what the family's decoder layer computes:

- ``llama``: RMSNorm before attention and MLP, SiLU-gated MLP (the form the native layer started with);
- ``qwen3``: plus RMSNorms on each query and key head;
- ``gemma3``: ``1 + w`` RMSNorms before *and after* attention and MLP (sandwich), q/k norms, GeLU-tanh, five
  sliding-window layers (window :data:`GEMMA3_WINDOW`) for each full-attention layer, embeddings scaled;
- ``mixtral``: the Llama form with a top-2 mixture of :data:`MIXTRAL_EXPERTS` experts of MLP width.

Written with transformers' own config classes (``AutoConfig.for_model``), so every engine loads the family it
names. The vocabulary, special tokens and norm epsilon come from SmolLM2's config (its tokenizer serves).
"""

from __future__ import annotations

from typing import Any

FORMS = ("llama", "qwen3", "gemma3", "mixtral")
GEMMA3_WINDOW = 128
"""Sliding window of Gemma 3's local layers: under the burst's longest context, so windows cut."""
MIXTRAL_EXPERTS = 8
SHARED_KEYS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "tie_word_embeddings")
"""Taken from SmolLM2's config by every form (tokenizer and head match it)."""
ROPE_KEYS = ("rope_parameters", "rope_theta", "max_position_embeddings", "rms_norm_eps")
"""Taken from SmolLM2's config by the forms whose family reads them the Llama way (not Gemma 3: two RoPE bases)."""
MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text", "mixtral": "mixtral"}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def form_config_dict(form: str, source: dict[str, Any], shape: dict[str, int]) -> dict[str, Any]:
    """The config keys of ``form`` at ``shape`` (the spec's sizes), with SmolLM2's (``source``) vocabulary.

    ``shape`` holds ``num_hidden_layers``, ``hidden_size``, ``head_dim``, ``num_attention_heads``,
    ``num_key_value_heads`` and ``intermediate_size``. Raises ``ValueError`` for an unknown form.
    """
    if form not in FORMS:
        raise ValueError(f"unknown host-bound form {form!r}: choose from {FORMS}")
    keys = SHARED_KEYS + (() if form == "gemma3" else ROPE_KEYS)
    out: dict[str, Any] = {key: source[key] for key in keys if key in source}
    out.update(shape, architectures=[ARCHITECTURES[form]], model_type=MODEL_TYPES[form])
    if form == "llama":
        out.update(hidden_act="silu", attention_bias=False, mlp_bias=False)
    elif form == "qwen3":
        out.update(hidden_act="silu", attention_bias=False, use_sliding_window=False)
    elif form == "gemma3":
        layers = shape["num_hidden_layers"]
        out.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=shape["head_dim"],
            sliding_window=GEMMA3_WINDOW,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
            rms_norm_eps=source.get("rms_norm_eps", 1e-6),
            max_position_embeddings=source.get("max_position_embeddings", 8192),
        )
    else:  # mixtral
        out.update(hidden_act="silu", num_local_experts=MIXTRAL_EXPERTS, num_experts_per_tok=2)
    return out


def build_model(form: str, config_dict: dict[str, Any]) -> Any:
    """The fp32 transformers model of ``config_dict`` (call under the spec's seed)."""
    import torch
    import transformers

    fields = {k: v for k, v in config_dict.items() if k not in ("model_type", "architectures")}
    config = transformers.AutoConfig.for_model(MODEL_TYPES[form], **fields)
    config.architectures = config_dict["architectures"]
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
