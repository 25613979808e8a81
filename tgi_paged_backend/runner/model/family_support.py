"""Which models the paged path serves, decided at start-up, before the first request.

The paged path serves a model through transformers' own modeling code, with our attention function
selected by name (:mod:`.attention`). That is exact only when every attention layer of the model
calls that function, and only for what the function implements. Everything else is refused here
with a message naming the architecture, so an unserved family stops the shard at start instead of
answering with wrong tokens:

- :func:`unsupported_reason` reads the config alone: encoder-decoder and multimodal models (each
  vision-language family stock TGI serves with its own reason, :data:`VLM_FAMILIES`),
  state-space / linear-attention layers (Mamba, Jamba, Falcon-H1, ...), multi-head latent attention
  outside DeepSeek-V2/V3's transformers classes (whose attention :mod:`.mla` replaces), ALiBi outside Bloom,
  MPT and Falcon (whose attention modules :mod:`.alibi` and :mod:`.falcon` replace, refusing the variants they
  do not reproduce);
- :func:`check_attention_calls` is the generic backstop, run by the runner on a one-token probe
  forward: every decoder layer must call our attention function exactly once (catches
  ``trust_remote_code`` code and any family that computes attention its own way).

Both return a reason (or ``None``); :mod:`tgi_paged_backend.runner.model.loader` turns one into
:class:`~tgi_paged_backend.runner.model.loader.ModelLoadError` with :func:`refusal_message`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tgi_paged_backend.runner.attention import METADATA_KWARG, PagedAttentionMetadata, mask_placeholder
from tgi_paged_backend.runner.families import falcon, mla
from tgi_paged_backend.runner.families.alibi import ALIBI_MODEL_TYPES, alibi_refusal
from tgi_paged_backend.runner.model import vlm_loading

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SERVED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
"""``config.layer_types`` entries the paged attention implements (per-layer windows included)."""

BYPASSING_FAMILIES: dict[str, str] = {}
"""``model_type`` -> why transformers' modeling code for it cannot run over the paged KV cache."""

SSM_MODEL_TYPES = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "falcon_h1",
        "jamba",
        "zamba",
        "zamba2",
        "bamba",
        "granitemoehybrid",
        "nemotron_h",
        "rwkv",
        "recurrent_gemma",
        "lfm2",
        "qwen3_next",
        "xlstm",
        "plamo2",
    }
)
"""Families with state-space, recurrent or linear-attention layers (state the KV pool does not hold)."""

_VLM_NOT_YET = (
    "vision-language models are not served yet (issue 40, docs/vlm.md): the image chunks of input_chunks "
    "are carried and validated, but the vision tower's embeddings are not merged at the image placeholders"
)
VLM_FAMILIES: dict[str, str] = {
    "llama4": _VLM_NOT_YET + ", and Llama 4's chunked local attention layers are not implemented",
    "mllama": "Mllama (Llama 3.2 Vision) attends to the image through cross-attention layers, whose "
    "per-request vision KV is not held by the paged KV pool",
    "idefics": "Idefics (v1) attends to the image through gated cross-attention layers, whose per-request "
    "vision KV is not held by the paged KV pool",
}
"""Vision-language ``model_type``s stock TGI 3.3 serves -> why the paged path refuses them today (LLaVA-NeXT,
Idefics2/3, SmolVLM, Qwen2-VL, Qwen2.5-VL, Gemma 3 and PaliGemma are served:
:data:`.vlm_loading.SERVED_VLM_MODEL_TYPES`)."""

_MULTIMODAL_SUBCONFIGS = ("vision_config", "audio_config", "speech_config", "vision_tower_config")


def architecture_name(config: Any) -> str:
    """``LlamaForCausalLM (model_type 'llama')``: what the refusal messages call the model."""
    archs = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", "?")
    return f"{archs[0]} (model_type {model_type!r})" if archs else f"model_type {model_type!r}"


def refusal_message(config: Any, reason: str) -> str:
    """The start-up error: the architecture, why, and what to do instead."""
    return (
        f"{architecture_name(config)} is not served by the paged backend: {reason}. "
        "Serve it with TGI_BACKEND=stock (TGI's own server) instead"
    )


def unsupported_reason(config: Any) -> str | None:
    """Why the paged path cannot serve a model of ``config`` exactly, or ``None`` when it may.

    ``None`` is not yet a promise: :func:`check_attention_calls` still has to see every layer call
    the paged attention function.
    """
    model_type = str(getattr(config, "model_type", ""))
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not served (the paged backend runs decoder-only causal LMs)"
    if model_type in VLM_FAMILIES:
        return VLM_FAMILIES[model_type]
    if vlm_loading.is_served_vlm(config):  # its language model decides (the tower never touches the pool)
        return unsupported_reason(config.text_config)
    sub = [name for name in _MULTIMODAL_SUBCONFIGS if getattr(config, name, None) is not None]
    if sub:
        return f"multimodal models are not served ({', '.join(sub)} present; only text decoders are)"
    if model_type in SSM_MODEL_TYPES:
        return "state-space / recurrent layers are not served (their state is not a paged KV cache)"
    layer_types = getattr(config, "layer_types", None) or ()
    others = sorted(set(layer_types) - SERVED_LAYER_TYPES)
    if others:
        return f"layer types {others} are not served (only {sorted(SERVED_LAYER_TYPES)} are)"
    if model_type == falcon.MODEL_TYPE:  # served through its own attention module (.falcon)
        return falcon.unsupported_reason(config)
    if model_type in BYPASSING_FAMILIES:
        return BYPASSING_FAMILIES[model_type]
    if getattr(config, "kv_lora_rank", None):  # served through the paged latent attention (.mla)
        return mla.unsupported_reason(config)
    if model_type in ALIBI_MODEL_TYPES:
        return alibi_refusal(config)
    if getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None), "alibi", False):
        return (
            "ALiBi position biases are applied only by the paged attention modules of Bloom, MPT and Falcon "
            "(runner/families/alibi.py, falcon.py); this family computes its attention its own way"
        )
    return None


def probe_layer_calls(model: PreTrainedModel) -> list[int]:
    """``layer_idx`` of every call of the paged attention function in a one-token forward.

    The attention function runs in probe mode (zeros out, no pool), so this costs one token's
    projections and MLP. Exceptions of the modeling code propagate to the caller.
    """
    device = next(model.parameters()).device
    calls: list[int] = []
    metadata = PagedAttentionMetadata(batch=None, k_caches=(), v_caches=(), layer_calls=calls)
    token = torch.zeros((1, 1), dtype=torch.int64, device=device)
    with torch.inference_mode():
        model(
            input_ids=token,
            position_ids=token,
            attention_mask=mask_placeholder(device, model.dtype),
            use_cache=False,
            return_dict=True,
            **{METADATA_KWARG: metadata},
        )
    return calls


def check_attention_calls(num_layers: int, layer_calls: Sequence[int]) -> str | None:
    """Why the probe forward shows the model bypasses paged attention, or ``None`` when it does not.

    ``layer_calls`` are the ``layer_idx`` values our attention function saw during one forward;
    each of the ``num_layers`` layers must appear exactly once (the KV pool holds one K and one V
    tensor per layer, indexed by ``layer_idx``).
    """
    expected = list(range(num_layers))
    if sorted(layer_calls) == expected:
        return None
    if not layer_calls:
        return (
            "no layer called the paged attention function: this modeling code computes attention its own "
            "way instead of through transformers' attention interface"
        )
    return (
        f"the paged attention function was called for layers {sorted(layer_calls)}, expected each of "
        f"{expected} once: some layers bypass transformers' attention interface or share KV"
    )
