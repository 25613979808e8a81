"""ALiBi families (Bloom, MPT): their attention modules swapped for ones over the paged KV cache.

transformers' Bloom and MPT compute attention inside their own modules (ALiBi biases added to the scores), not
through the attention interface, so the paged attention function is never called. :func:`install_alibi_attention`
replaces each layer's attention module, at load and before the start-up probe, with a small module that keeps the
checkpoint's own projections (the same ``nn.Linear`` objects, under the same names), writes K/V into the paged pool
and attends with the paged kernels' ``alibi_slopes`` (one slope per head; the kernels add
``slope * (key_pos - query_pos)``, which differs from Bloom's ``slope * key_pos`` and MPT's
``slope * (key_pos - last_pos)`` by a constant per query row, cancelled by the softmax).

The decoder layers do not pass the model call's keyword arguments down, so the step's
:class:`~tgi_paged_backend.runner.attention.PagedAttentionMetadata` reaches the modules through a forward pre-hook
on the top-level model (:class:`StepHolder`, one per model).

What these modules do not reproduce is refused at start (:func:`alibi_refusal`), with the reason.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tgi_paged_backend.runner.attention import (
    HAS_MASK_INTERFACE,
    METADATA_KWARG,
    PagedAttentionMetadata,
    paged_attention,
    paged_attention_forward,
    step_metadata,
)

ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt"})
"""Model types whose attention this module replaces."""

BOOL_MASK_NAME = "tgi_paged_bool_mask"
"""Attention implementation MPT models run under: MPT's model calls ``.to(torch.bool)`` on the causal mask, which the
paged backend's no-op mask (``None``) does not allow, so this name's mask builder returns a ``[1, 1, 1, 1]`` stand-in
(ignored by the ALiBi modules, like every mask here)."""


def bloom_alibi_slopes(num_heads: int) -> torch.Tensor:
    """Bloom's slopes (fp32 ``[num_heads]``, as ``transformers``' Bloom computes them): for the largest power of two
    ``p <= num_heads``, ``b**1 .. b**p`` with ``b = 2**(-8/p)``; the remaining heads take the odd powers
    ``c**1, c**3, ..`` of ``c = 2**(-8/(2p))``."""
    p = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.tensor(2.0 ** (-8.0 / p), dtype=torch.float32) ** torch.arange(1, p + 1, dtype=torch.int32)
    if p == num_heads:
        return slopes
    odd = torch.arange(1, 2 * (num_heads - p), 2, dtype=torch.int32)
    return torch.cat([slopes, torch.tensor(2.0 ** (-4.0 / p), dtype=torch.float32) ** odd])


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """MPT's slopes (fp32 ``[num_heads]``): ``2**-(i * alibi_bias_max / m)`` for ``i = 1 .. m``, ``m`` the power of
    two ``>= num_heads``; when ``m > num_heads``, the odd-indexed ones first, then the even-indexed, cut to
    ``num_heads``."""
    m = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / torch.pow(2.0, torch.arange(1, m + 1, dtype=torch.float32) * (alibi_bias_max / m))
    if m == num_heads:
        return slopes
    return torch.cat([slopes[1::2], slopes[::2]])[:num_heads].contiguous()


def alibi_refusal(config: Any) -> str | None:
    """Why a Bloom or MPT ``config`` cannot be served exactly by these modules, or ``None`` when it can."""
    if config.model_type == "bloom":
        if getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False):
            return (
                "Bloom with slow_but_exact and pretraining_tp > 1 sums its attention output projection in "
                "pretraining_tp slices, which the paged ALiBi attention does not reproduce"
            )
        return None
    attn = config.attn_config
    if getattr(attn, "qk_ln", False):
        return (
            "MPT with attn_config.qk_ln: transformers' MPT does not apply those norms, so no reference to be exact to"
        )
    if not getattr(attn, "alibi", True):
        return "MPT with attn_config.alibi false: transformers' MPT adds ALiBi biases whatever the config says"
    if float(getattr(attn, "alibi_bias_max", 8)) != 8.0:
        return (
            f"MPT with attn_config.alibi_bias_max={attn.alibi_bias_max}: transformers' MPT builds its slopes with 8 "
            "whatever the config says"
        )
    for option in ("prefix_lm", "attn_uses_sequence_id"):
        if getattr(attn, option, False):
            return f"MPT with attn_config.{option}: transformers' MPT ignores it (plain causal attention)"
    return None


class StepHolder:
    """The current model call's step metadata, set by a forward pre-hook on the top-level model."""

    def __init__(self) -> None:
        self.current: PagedAttentionMetadata | None = None

    def capture(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.current = kwargs.get(METADATA_KWARG)

    def metadata(self) -> PagedAttentionMetadata:
        return step_metadata({METADATA_KWARG: self.current})


class _AlibiAttention(nn.Module):
    """Shared part: the layer index, the slopes (an fp32 buffer, moved with the model, cut to a rank's heads under
    tensor parallelism by :mod:`tgi_paged_backend.runner.parallel.head_tensors`) and the step holder."""

    alibi_slopes: torch.Tensor

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int, slopes: torch.Tensor, holder: StepHolder) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.register_buffer("alibi_slopes", slopes.float().contiguous(), persistent=False)
        self.holder = holder

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """``[T, H, D]`` q/k/v -> ``[1, T, H * D]``: store K/V in the pool and attend over the paged K/V with ALiBi."""
        out = paged_attention(
            self.holder.metadata(), self.layer_idx, q, k, v, scaling=scaling, alibi_slopes=self.alibi_slopes
        )
        return out.reshape(1, q.shape[0], self.num_heads * self.head_dim)


class BloomPagedAttention(_AlibiAttention):
    """``BloomAttention`` over the paged pool: fused ``query_key_value`` (per head ``[q, k, v]`` interleaved), the
    paged ALiBi attention, ``dense``, plus the residual (Bloom adds it inside its attention)."""

    query_key_value: nn.Module
    dense: nn.Module

    def __init__(self, original: Any, holder: StepHolder) -> None:
        super().__init__(
            int(original.layer_idx), original.num_heads, original.head_dim, bloom_alibi_slopes(original.num_heads),
            holder,
        )  # fmt: skip
        self.query_key_value = original.query_key_value
        self.dense = original.dense
        self.scaling = float(original.inv_norm_factor)

    def split_heads(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[.., T, hidden]`` -> q, k, v ``[T, H, D]`` (this module's heads: a rank's share under tensor
        parallelism, whose rows of ``query_key_value`` are its heads' runs)."""
        tokens = hidden_states.shape[-2]
        fused = self.query_key_value(hidden_states).view(tokens, self.num_heads, 3, self.head_dim)
        return fused[:, :, 0], fused[:, :, 1], fused[:, :, 2]

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor, *args: Any, **kwargs: Any):
        return residual + self.dense(self.attend(*self.split_heads(hidden_states), self.scaling)), None


class MptPagedAttention(_AlibiAttention):
    """``MptAttention`` over the paged pool: ``Wqkv`` (``[q; k; v]`` blocks), ``clip_qkv`` clamping, the paged ALiBi
    attention at ``softmax_scale``, ``out_proj``."""

    Wqkv: nn.Module
    out_proj: nn.Module

    def __init__(self, original: Any, holder: StepHolder) -> None:
        super().__init__(
            int(original.layer_idx), original.n_heads, original.head_dim, mpt_alibi_slopes(original.n_heads), holder
        )
        self.Wqkv = original.Wqkv
        self.out_proj = original.out_proj
        self.clip_qkv: float | None = original.clip_qkv
        self.scaling = float(original.softmax_scale)

    def split_heads(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[.., T, hidden]`` -> q, k, v ``[T, H, D]``, clamped to ``clip_qkv`` (this module's heads: a rank's
        share under tensor parallelism, its rows of each ``Wqkv`` block)."""
        tokens = hidden_states.shape[-2]
        mixed = self.Wqkv(hidden_states)
        if self.clip_qkv:
            mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = (part.reshape(tokens, self.num_heads, self.head_dim) for part in mixed.chunk(3, dim=-1))
        return q, k, v

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self.out_proj(self.attend(*self.split_heads(hidden_states), self.scaling)), None


def _bool_mask_stand_in(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
    return torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=device)


def _use_bool_mask(model: Any) -> None:
    """Run ``model`` under :data:`BOOL_MASK_NAME` (transformers >= 4.53 builds masks by implementation name)."""
    if not HAS_MASK_INTERFACE:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(BOOL_MASK_NAME, paged_attention_forward)
    AttentionMaskInterface.register(BOOL_MASK_NAME, _bool_mask_stand_in)
    model.config._attn_implementation = BOOL_MASK_NAME


def install_alibi_attention(model: Any) -> int:
    """Swap every attention module of a Bloom or MPT ``model`` (in place) for the paged ALiBi one; returns how many
    (0 for other families). Call before the start-up probe and after weights are final (quantized linears kept)."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ALIBI_MODEL_TYPES:
        return 0
    holder = StepHolder()
    model.register_forward_pre_hook(holder.capture, with_kwargs=True)
    cls: Any
    if model_type == "bloom":
        blocks, name, cls = model.transformer.h, "self_attention", BloomPagedAttention
    else:
        blocks, name, cls = model.transformer.blocks, "attn", MptPagedAttention
        _use_bool_mask(model)
    for block in blocks:
        setattr(block, name, cls(getattr(block, name), holder))
    return len(blocks)


def has_alibi_attention(model: nn.Module) -> bool:
    """Whether :func:`install_alibi_attention` swapped ``model``'s attention."""
    return any(isinstance(m, _AlibiAttention) for m in model.modules())
