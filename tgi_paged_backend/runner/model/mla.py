"""Multi-head latent attention (DeepSeek-V2, DeepSeek-V3) over the paged latent pool.

transformers' DeepSeek attention keeps the compressed KV in its cache but decompresses it for every step
(``kv_b_proj`` applied to every cached token, per head keys and values handed to the attention function),
so through the attention interface the pool would hold a key and a value per head. :func:`install_latent_attention`
replaces each layer's ``self_attn``, at load (after quantization, before the start-up probe), with
:class:`PagedLatentAttention`, which keeps the checkpoint's own projections under the same names and

- computes the query as transformers does (``q_proj``, or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``),
  split into ``q_nope`` and ``q_pe``;
- computes the token's pool entry: ``kv_a_proj_with_mqa`` split into the latent (``kv_a_layernorm``-ed) and the
  shared RoPE key, RoPE applied to ``q_pe`` and the key exactly as the model's class does (V2: complex
  rotation of interleaved pairs in fp32; V3: ``rope_interleave`` or ``rotate_half``), entry
  ``[latent ; k_pe]`` of width ``Dk = kv_lora_rank + qk_rope_head_dim``, stored at the step's slots (one KV
  head, the layer's one pool tensor);
- attends in latent space: ``q = [q_nope @ W_uk ; q_pe]`` (``W_uk``: per head the key part of ``kv_b_proj``,
  ``qk_nope_head_dim x kv_lora_rank``), one shared KV head (MQA), value = the entry's first ``kv_lora_rank``
  columns, softmax scale the model's (yarn ``mscale`` included); the latent output of each head goes
  through ``W_uv`` (the value part of ``kv_b_proj``) and ``o_proj``.

``kv_b_proj`` is taken apart at install into the two per-head parameters ``w_uk`` ``[H, nope, rank]`` and
``w_uv`` ``[H, v, rank]`` (dense, in the model dtype, dequantized when a quantized linear held them), since the
absorbed path multiplies by them, not through the linear. Prefill uses the same absorbed path. The decoder
layers pass the model call's keyword arguments to ``self_attn``, so the step's metadata arrives as usual.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from tgi_paged_backend.runner.attention import paged_attention, step_metadata

MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3"})
"""Model types whose attention this module replaces (transformers' own DeepSeek classes)."""


def unsupported_reason(config: Any) -> str | None:
    """Why a config with ``kv_lora_rank`` is not served exactly, or ``None`` when it is."""
    if str(getattr(config, "model_type", "")) not in MLA_MODEL_TYPES:
        return (
            "multi-head latent attention outside transformers' DeepSeek-V2/V3 classes (its own modeling code) "
            "is not served: only those classes' attention is replaced by the paged latent attention"
        )
    return None


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """``linear``'s ``[out, in]`` weight in ``dtype``: a plain linear's own, a quantized one's dequantized."""
    dequantize = getattr(linear, "dequantized_weight", None)
    if callable(dequantize):
        return cast(torch.Tensor, dequantize(dtype))
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"kv_b_proj is a {type(linear).__name__} without a dense or dequantizable weight")
    return weight.detach().to(dtype)


def rotate_complex(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's RoPE: ``x``'s interleaved pairs as complex numbers (fp32) times ``freqs`` (complex
    ``[T, rope / 2]``), back to real pairs in ``x``'s dtype, as transformers' ``apply_rotary_emb`` does."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.unsqueeze(1)).flatten(-2).type_as(x)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's ``rope_interleave`` RoPE (``cos``/``sin`` ``[T, 1, rope]``): each pair ``(x[2i], x[2i+1])``
    rotated by angle ``i``, the results laid out evens first, then odds (transformers' layout)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (DeepSeek-V3 without ``rope_interleave``)."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


class PagedLatentAttention(nn.Module):
    """A DeepSeek layer's multi-head latent attention over the paged latent pool (see the module docstring).

    Takes the place of ``DeepseekV2Attention`` / ``DeepseekV3Attention`` in ``self_attn`` and accepts the same
    call; ``attention_mask``, ``cache`` and ``position_ids`` are unused (causality, request boundaries and
    history come from the step's metadata).
    """

    q_proj: nn.Module | None
    q_a_proj: nn.Module | None
    q_a_layernorm: nn.Module | None
    q_b_proj: nn.Module | None
    kv_a_proj_with_mqa: nn.Module
    kv_a_layernorm: nn.Module

    def __init__(self, attention: nn.Module, config: Any) -> None:
        super().__init__()
        for name in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm"):
            setattr(self, name, getattr(attention, name))
        self.o_proj = cast(nn.Module, attention.o_proj)
        self.layer_idx = int(cast(int, attention.layer_idx))
        self.num_heads = int(config.num_attention_heads)
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.qk_nope_head_dim = int(config.qk_nope_head_dim)
        self.qk_rope_head_dim = int(config.qk_rope_head_dim)
        self.v_head_dim = int(config.v_head_dim)
        self.scaling = float(cast(float, attention.scaling))
        self.rope_interleave = bool(getattr(config, "rope_interleave", False))
        dtype = cast(torch.Tensor, self.kv_a_layernorm.weight).dtype  # norms stay in the model dtype
        per_head = dense_weight(cast(nn.Module, attention.kv_b_proj), dtype).view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        self.w_uk = nn.Parameter(per_head[:, : self.qk_nope_head_dim].contiguous(), requires_grad=False)
        """Per head, the key part of ``kv_b_proj``: ``[H, qk_nope_head_dim, kv_lora_rank]``."""
        self.w_uv = nn.Parameter(per_head[:, self.qk_nope_head_dim :].contiguous(), requires_grad=False)
        """Per head, the value part of ``kv_b_proj``: ``[H, v_head_dim, kv_lora_rank]``."""

    def keep_heads(self, rank: int, world_size: int) -> None:
        """Keep this rank's heads of ``w_uk``/``w_uv`` (tensor parallelism,
        :mod:`tgi_paged_backend.runner.parallel.slicing`, which cuts the query projection's rows and row-splits
        ``o_proj``); the latent's projection and norm (and ``q_a_proj``) stay whole, so every rank stores the same
        latent."""
        local = self.num_heads // world_size
        heads = slice(rank * local, (rank + 1) * local)
        self.w_uk = nn.Parameter(self.w_uk.detach()[heads].clone(), requires_grad=False)
        self.w_uv = nn.Parameter(self.w_uv.detach()[heads].clone(), requires_grad=False)
        self.num_heads = local

    def rotate(self, x: torch.Tensor, position_embeddings: Any) -> torch.Tensor:
        """RoPE on ``x`` ``[T, heads, rope]`` as the model's class applies it (its ``position_embeddings``)."""
        if isinstance(position_embeddings, torch.Tensor):  # V2: complex frequencies [1, T, rope / 2]
            return rotate_complex(x, position_embeddings[0].to(x.device))
        cos, sin = (t[0].unsqueeze(1) for t in position_embeddings)  # V3: [T, 1, rope]
        return rotate_interleaved(x, cos, sin) if self.rope_interleave else rotate_halves(x, cos, sin)

    def query(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return cast(torch.Tensor, self.q_proj(hidden_states))
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return cast(torch.Tensor, self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states))))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if hidden_states.shape[0] != 1:
            raise ValueError(f"expects one packed sequence (batch dim 1), got {hidden_states.shape[0]}")
        if position_embeddings is None:
            raise ValueError("DeepSeek's paged latent attention needs the rotary position_embeddings of the model")
        metadata = step_metadata(kwargs)
        tokens, heads, rank = hidden_states.shape[1], self.num_heads, self.kv_lora_rank
        q = self.query(hidden_states)[0].view(tokens, heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states)[0].split([rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = self.rotate(q_pe, position_embeddings)
        k_pe = self.rotate(k_pe.unsqueeze(1), position_embeddings)
        entry = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # [T, 1, Dk]: the one pool row of the token
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, rank]
        query = torch.cat([q_latent, q_pe], dim=-1)
        out = paged_attention(
            metadata, self.layer_idx, query, entry, entry[..., :rank], scaling=self.scaling, values_in_keys=True
        )  # [T, H, rank]: each head's mix of latents
        values = torch.bmm(out.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(values.reshape(1, tokens, heads * self.v_head_dim)), None


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers decoder layers")
    return layers


def install_latent_attention(model: nn.Module) -> int:
    """Put :class:`PagedLatentAttention` in every decoder layer of a DeepSeek-V2/V3 ``model`` (in place); returns
    the layers changed (0 for any other model)."""
    config: Any = model.config
    if str(getattr(config, "model_type", "")) not in MLA_MODEL_TYPES:
        return 0
    layers = _decoder_layers(model)
    for layer in layers:
        layer.self_attn = PagedLatentAttention(cast(nn.Module, layer.self_attn), config)
    return len(layers)


def has_latent_attention(model: nn.Module) -> bool:
    """Whether ``model``'s attention runs through :class:`PagedLatentAttention`."""
    return any(isinstance(m, PagedLatentAttention) for m in model.modules())
