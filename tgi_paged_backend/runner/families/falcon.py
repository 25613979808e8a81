"""Falcon over the paged KV cache: our own attention module in place of transformers' Falcon attention.

transformers' Falcon does not go through the attention interface: ``FalconDecoderLayer`` picks its
attention class from ``FALCON_ATTENTION_CLASSES`` (eager / sdpa / flash) by name, and neither
``FalconForCausalLM`` nor ``FalconModel`` nor the decoder layer passes extra keyword arguments down, so
neither our attention name nor the step's metadata reaches it. The model is therefore loaded with
:data:`LOAD_ATTENTION` and, before anything runs, :func:`install_paged_falcon`

- replaces every layer's ``self_attention`` by :class:`PagedFalconAttention`, which keeps the layer's own
  ``query_key_value`` and ``dense`` linears (``FalconLinear``: matmul, then bias), splits the fused
  projection exactly as transformers does for the layer's variant, applies the rotary embedding the model
  computed (``position_embeddings``), and stores/attends through :func:`~..attention.paged_attention`;
- hands the step's :class:`~..attention.PagedAttentionMetadata` (the ``tgi_paged_metadata`` keyword of the
  model call) to those modules for the duration of the call, through a forward pre-hook on the top module
  (:class:`StepChannel`); it is cleared when the call ends, whatever happens;
- names our attention in the config, so the model's mask builder is our no-op one (no ``[T, T]`` mask).

Decoder layers, norms, MLP, rotary embedding and LM head stay transformers' own. Served variants: the new
decoder architecture (grouped KV heads, ``num_kv_heads``, one or two layer norms), the old architecture with
``multi_query`` (one KV head) or without (one KV head per query head), ``parallel_attn`` on or off, each
with rotary positions or with ALiBi (``alibi=True``, Falcon-RW).

ALiBi as Falcon has it: its slopes are Bloom's (:func:`~.alibi.bloom_alibi_slopes`), rounded to bfloat16
(``build_alibi_tensor`` casts them before multiplying by the key positions), and the bias is added to the raw
``q . k`` *before* the ``1 / sqrt(head_dim)`` scaling, so the kernels (which add ``slope * (key - query)`` after
scaling) get ``slope * inv_norm_factor`` (:func:`falcon_alibi_slopes`). The bias counts once, as in the original
Falcon-RW code and transformers' SDPA path (Falcon's default). The eager path of the transformers installed here
(5.24) adds it twice (the model folds ``alibi / sqrt(head_dim)`` into the causal mask, and the eager branch adds
``alibi`` again before scaling), which is not the trained model; the tests compare the ALiBi variants with the SDPA
path (``tests/helpers/tiny_models.reference_attention``). One rounding is not reproduced: transformers (like the
original code) also rounds each product ``slope * key_pos`` to bfloat16, a bias no longer linear in the position
once the product needs more than 8 significant bits (from position 256 on for power-of-two slopes, earlier for the
others); the kernels compute ``slope * (key - query)`` in fp32, so at long contexts the two differ by that rounding
(at most 1/256 of the bias).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from tgi_paged_backend.runner.attention import METADATA_KWARG, PagedAttentionMetadata, paged_attention, step_metadata
from tgi_paged_backend.runner.families.alibi import bloom_alibi_slopes
from tgi_paged_backend.runner.model.spec import num_kv_heads_of

MODEL_TYPE = "falcon"

LOAD_ATTENTION = "eager"
"""The ``attn_implementation`` Falcon is built with: its layers' attention modules are replaced right after."""


def unsupported_reason(config: Any) -> str | None:
    """Why a Falcon variant is not served exactly, or ``None`` when it is."""
    if not config.new_decoder_architecture and not config.multi_query:
        if config.num_kv_heads != config.num_attention_heads:
            return (
                f"Falcon's old architecture without multi_query has one KV head per query head, but "
                f"num_kv_heads={config.num_kv_heads} != num_attention_heads={config.num_attention_heads} "
                "(transformers' own Falcon cannot run this config either)"
            )
    return None


def falcon_alibi_slopes(num_heads: int, head_dim: int) -> torch.Tensor:
    """The slopes the paged kernels need for Falcon's ALiBi (fp32 ``[num_heads]``): Bloom's slopes rounded to
    bfloat16 as transformers' Falcon rounds them, times ``1 / sqrt(head_dim)`` (Falcon scales ``q . k + bias``
    together; the kernels add the bias after scaling)."""
    return bloom_alibi_slopes(num_heads).bfloat16().float() * (1.0 / math.sqrt(head_dim))


@dataclass(slots=True)
class StepChannel:
    """The metadata of the model call in progress, shared by one model's :class:`PagedFalconAttention`."""

    metadata: PagedAttentionMetadata | None = None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (``rotate_half``: the second half of the head, negated, then the
    first), the rotary embedding as transformers applies it to Falcon, the same operations in the same order."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (turned * sin)


class PagedFalconAttention(nn.Module):
    """A Falcon layer's attention over the paged KV cache (see the module docstring).

    Takes the place of ``FalconAttention`` in ``FalconDecoderLayer.self_attention`` and accepts the same
    call; ``alibi``, ``attention_mask``, ``layer_past`` and ``position_ids`` are unused (the ALiBi variants'
    slopes are the :attr:`alibi_slopes` buffer, one per query head, sliced with the heads under tensor
    parallelism; causality, request boundaries and history come from the step's metadata).
    """

    alibi_slopes: torch.Tensor | None

    def __init__(self, attention: nn.Module, config: Any, layer_idx: int, channel: StepChannel) -> None:
        super().__init__()
        self.query_key_value = cast(nn.Module, attention.query_key_value)
        self.dense = cast(nn.Module, attention.dense)
        self.layer_idx = layer_idx
        self.num_heads = int(config.num_attention_heads)
        self.num_key_value_heads = num_kv_heads_of(config)
        self.head_dim = int(config.hidden_size) // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.new_decoder_architecture = bool(config.new_decoder_architecture)
        self.multi_query = bool(config.multi_query)
        self.channel = channel
        slopes = falcon_alibi_slopes(self.num_heads, self.head_dim) if getattr(config, "alibi", False) else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    def split_heads(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, qkv]`` -> q ``[T, H, D]``, k and v ``[T, Hkv, D]``, in the layout of the layer's variant.

        New architecture: per KV group, its ``H / Hkv`` query heads then its key then its value (query head
        ``h`` reads KV head ``h // (H / Hkv)``, what transformers' broadcast of the group's key gives). Old
        architecture with ``multi_query``: all query heads, then one key, then one value. Without: per head,
        its query, key and value.
        """
        tokens, heads, dim = fused.shape[0], self.num_heads, self.head_dim
        if self.new_decoder_architecture:
            group = heads // self.num_key_value_heads
            qkv = fused.view(tokens, self.num_key_value_heads, group + 2, dim)
            return qkv[:, :, :group].reshape(tokens, heads, dim), qkv[:, :, group], qkv[:, :, group + 1]
        if self.multi_query:
            qkv = fused.view(tokens, heads + 2, dim)
            return qkv[:, :heads], qkv[:, heads : heads + 1], qkv[:, heads + 1 :]
        qkv = fused.view(tokens, heads, 3, dim)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def forward(
        self,
        hidden_states: torch.Tensor,
        alibi: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        layer_past: Any = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if hidden_states.shape[0] != 1:
            raise ValueError(f"expects one packed sequence (batch dim 1), got {hidden_states.shape[0]}")
        if position_embeddings is None and self.alibi_slopes is None:
            raise ValueError("Falcon's paged attention needs the rotary position_embeddings of the model")
        metadata = self.channel.metadata
        if metadata is None:
            metadata = step_metadata(kwargs)  # its error says how to call the model
        tokens = hidden_states.shape[1]
        q, k, v = self.split_heads(self.query_key_value(hidden_states)[0])
        if self.alibi_slopes is None and position_embeddings is not None:
            cos, sin = (t[0].unsqueeze(1) for t in position_embeddings)  # [T, 1, D]: one angle per token, all heads
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = paged_attention(metadata, self.layer_idx, q, k, v, scaling=self.scaling, alibi_slopes=self.alibi_slopes)
        return self.dense(out.reshape(1, tokens, self.num_heads * self.head_dim)), None


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    transformer = getattr(model, "transformer", None)
    layers = getattr(transformer, "h", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no transformer.h decoder layers")
    return layers


def install_paged_falcon(model: nn.Module, attention_name: str) -> int:
    """Put :class:`PagedFalconAttention` in every decoder layer of the Falcon ``model`` (in place), route the
    model call's metadata to them and select ``attention_name``'s (no-op) mask; returns the layers changed."""
    config: Any = model.config
    channel = StepChannel()
    layers = _decoder_layers(model)
    for index, layer in enumerate(layers):
        layer.self_attention = PagedFalconAttention(cast(nn.Module, layer.self_attention), config, index, channel)

    def open_step(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        channel.metadata = kwargs.get(METADATA_KWARG)

    def close_step(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        channel.metadata = None

    model.register_forward_pre_hook(open_step, with_kwargs=True)
    model.register_forward_hook(close_step, with_kwargs=True, always_call=True)
    config._attn_implementation = attention_name
    return len(layers)
