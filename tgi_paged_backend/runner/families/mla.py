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

A prefill step may instead decompress (:attr:`PagedLatentAttention.prefill_form`): the entry is stored the same
way, then the latents of every block the step reads are expanded to per-head keys ``[latent @ W_uk^T ; k_pe]``
(``qk_nope + qk_rope`` wide) and values ``latent @ W_uv^T`` (``v_head_dim`` wide) in a temporary per-head paged
cache, and the full query attends over them as transformers' DeepSeek attention does. Per (query, key) pair and
head that costs ``qk_nope + qk_rope + v`` multiply-adds instead of the absorbed ``2 kv_lora_rank + qk_rope``, at
the price of expanding each context token once; ``auto`` takes whichever costs fewer at the step's shapes (long
prompts decompress; decode always absorbs).

``kv_b_proj`` is taken apart at install into the two per-head parameters ``w_uk`` ``[H, nope, rank]`` and
``w_uv`` ``[H, v, rank]`` (dense, in the model dtype, dequantized when a quantized linear held them), since both
paths multiply by them, not through the linear. The decoder layers pass the model call's keyword arguments to
``self_attn``, so the step's metadata arrives as usual.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

import tgi_paged_kernels
from tgi_paged_backend.runner.attention import PagedAttentionMetadata, paged_attention, step_metadata

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
    prefill_form = "auto"
    """How a prefill step attends: ``absorbed`` (as decode), ``decompressed`` (per-head keys and values expanded from
    the latents it reads), or ``auto``: whichever costs fewer multiply-adds at its shapes (:meth:`decompresses`)."""

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

    def decompresses(self, num_tokens: int, block_tables: torch.Tensor, block_size: int) -> bool:
        """Whether a prefill of ``num_tokens`` query tokens over ``block_tables`` (``[B, W]``) decompresses.

        ``auto`` compares multiply-adds from shapes alone (no device sync), with ``L = W x block_size`` context
        positions per request: absorbed ``T L H (2 rank + rope) + T H rank (nope + v)`` (the attention in latent
        space, then the query's absorption and the output's up-projection) against decompressed
        ``T L H (nope + rope + v) + B L H rank (nope + v)`` (attention per head, then expanding each request's
        context once).
        """
        if self.prefill_form != "auto":
            return self.prefill_form == "decompressed"
        requests, context = block_tables.shape[0], block_tables.shape[1] * block_size
        rank, rope, nope, v = self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
        saved = num_tokens * context * (2 * rank + rope - (nope + rope + v)) + num_tokens * rank * (nope + v)
        return saved > requests * context * rank * (nope + v)

    def attend_decompressed(
        self, metadata: PagedAttentionMetadata, q_nope: torch.Tensor, q_pe: torch.Tensor, entry: torch.Tensor
    ) -> torch.Tensor:
        """Store ``entry`` (``[T, 1, Dk]``) in the pool, then attend per head over the keys and values expanded from
        every block the step's requests read; ``[T, H, v_head_dim]``."""
        cache = metadata.k_caches[self.layer_idx]
        slot_mapping, block_tables = metadata.tables(self.layer_idx)
        tgi_paged_kernels.store_kv(entry, None, cache, None, slot_mapping, k_scale=metadata.k_scale)
        heads, rank = self.num_heads, self.kv_lora_rank
        rows = cache.index_select(0, block_tables.reshape(-1).long())[:, :, 0]  # [B W, block_size, Dk]
        if rows.dtype != q_nope.dtype:  # fp8 (scaled) or another dtype: read back as the kernels do
            rows = (rows.float() * metadata.k_scale).to(q_nope.dtype)
        latent, k_pe = rows.reshape(-1, rows.shape[-1]).split([rank, self.qk_rope_head_dim], dim=-1)
        shape = (*rows.shape[:2], heads)
        k_nope = (latent @ self.w_uk.reshape(-1, rank).t()).view(*shape, self.qk_nope_head_dim)
        keys = torch.cat([k_nope, k_pe.view(*rows.shape[:2], 1, -1).expand(*shape, -1)], dim=-1)
        values = (latent @ self.w_uv.reshape(-1, rank).t()).view(*shape, self.v_head_dim)
        tables = torch.arange(rows.shape[0], dtype=torch.int32, device=rows.device).view(block_tables.shape)
        batch = metadata.batch
        return tgi_paged_kernels.paged_prefill_attention(
            torch.cat([q_nope, q_pe], dim=-1), keys, values, tables, batch.query_start_loc, batch.seq_lens,
            scale=self.scaling,
        )  # fmt: skip

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
        probe, batch = metadata.layer_calls is not None, metadata.batch
        if not probe and not batch.is_decode:
            _, block_tables = metadata.tables(self.layer_idx)
            if self.decompresses(tokens, block_tables, metadata.k_caches[self.layer_idx].shape[1]):
                values = self.attend_decompressed(metadata, q_nope, q_pe, entry)
                return self.o_proj(values.reshape(1, tokens, heads * self.v_head_dim)), None
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
