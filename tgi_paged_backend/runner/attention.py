"""Paged attention as a transformers attention function.

:func:`register_attention` registers :func:`paged_attention_forward` with
``transformers.AttentionInterface`` under :data:`ATTENTION_NAME`; models are loaded with
``attn_implementation=ATTENTION_NAME``. Each HF attention layer then calls us after its
projections and RoPE. We write the new K/V into the layer's pool tensors at the step's physical
slots and attend over the paged K/V with the kernels of ``tgi_paged_kernels``.

The step's metadata (:class:`PagedAttentionMetadata`) reaches us as the explicit keyword argument
:data:`METADATA_KWARG`, passed by the runner through ``model(..., **{METADATA_KWARG: metadata})``;
transformers forwards unknown keyword arguments down to the attention function. There is no
module-level state besides the registration itself.

Masks: we never need one. transformers >= 4.53 builds masks through
``masking_utils.AttentionMaskInterface``; we register a no-op there. Older versions (4.51, the
TGI 3.3 pin) build a 4D mask in the model unless one is given; :func:`mask_placeholder` gives the
runner a ``[1, 1, 1, 1]`` stand-in that those versions pass through untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import tgi_paged_kernels
from tgi_paged_kernels import native_decode_for

ATTENTION_NAME = "tgi_paged"
"""Name under which the attention function (and its no-op mask) are registered."""

METADATA_KWARG = "tgi_paged_metadata"
"""Keyword argument that carries :class:`PagedAttentionMetadata` through ``model(...)``."""

_MaskInterface: Any
try:  # transformers >= 4.53
    from transformers.masking_utils import AttentionMaskInterface as _MaskInterface
except ImportError:  # transformers 4.51/4.52: the model builds its own 4D mask
    _MaskInterface = None

HAS_MASK_INTERFACE = _MaskInterface is not None
"""Whether this transformers builds masks through ``AttentionMaskInterface`` (>= 4.53)."""


@dataclass(frozen=True, slots=True)
class PagedAttentionMetadata:
    """Everything the attention layers need for one forward step.

    Attributes
    ----------
    batch : ForwardBatch
        The step's packed inputs, on the model's device.
    k_caches, v_caches : Sequence[torch.Tensor]
        Per-layer pool tensors, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    k_scale, v_scale : float
        Dequantization scales of fp8 KV (1.0 otherwise).
    layer_calls : list[int], optional
        Probe mode (start-up check, :mod:`runner.model.family_support`): each call appends its ``layer_idx``
        here and returns zeros, touching no pool (``batch`` and the caches are then unused).
    decode_gathers : dict
        CPU decode only: the step's gather plan per sliding window (``None``: full attention), built
        by the first layer that needs it and shared by the others (:meth:`decode_gather`).
    cpu_decode : str
        CPU decode only: the kernel (``TGI_PAGED_CPU_DECODE``): ``native`` (C++,
        :mod:`tgi_paged_kernels.cpu_native`), ``compiled`` (inductor, :mod:`tgi_paged_kernels.cpu_decode`)
        or ``sdpa`` (gather + SDPA).
    static : bool
        The static decode step (:mod:`runner.static.decode_step`): the batch is padded to fixed shapes and the
        block tables to a fixed width, so the CPU plan is the padded one, built from shapes alone
        (nothing read on the host, for ``torch.compile`` and CUDA graphs).
    """

    batch: Any  # ForwardBatch; typed loosely to keep this module free of runner imports
    k_caches: Sequence[torch.Tensor]
    v_caches: Sequence[torch.Tensor]
    k_scale: float = 1.0
    v_scale: float = 1.0
    layer_calls: list[int] | None = None
    decode_gathers: dict[tuple[int, int | None], Any] = field(default_factory=dict)
    static: bool = False
    cpu_decode: str = "native"
    seen_options: list[dict[str, Any]] | None = None
    """Check mode (:mod:`runner.cpu.fused_blocks`): each call of :func:`paged_attention` (the HF hook's and our own
    attention modules') appends the options its layer passed (``scaling``, ``sliding_window``, ``softcap``,
    ``sinks``, ``alibi``) before attending as usual."""
    layer_groups: tuple[int, ...] | None = None
    """With KV layer groups: each layer's group, whose slots and tables it uses (:meth:`tables`)."""

    def group_of(self, layer_idx: int) -> int:
        return 0 if self.layer_groups is None else self.layer_groups[layer_idx]

    def tables(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot_mapping, block_tables)`` of the layer's KV group."""
        group, batch = self.group_of(layer_idx), self.batch
        if group == 0:
            return batch.slot_mapping, batch.block_tables
        return batch.group_slot_mappings[group - 1], batch.group_block_tables[group - 1]

    def decode_gather(self, block_size: int, sliding_window: int | None, layer_idx: int = 0) -> Any:
        """The step's CPU decode plan for this window and the layer's group (``None`` on CUDA)."""
        if self.batch.block_tables.is_cuda:
            return None
        key = (self.group_of(layer_idx), sliding_window)
        plan = self.decode_gathers.get(key)
        if plan is None:
            plan = tgi_paged_kernels.plan_decode_gather(
                self.tables(layer_idx)[1], self.batch.seq_lens, block_size, sliding_window, padded=self.static
            )
            self.decode_gathers[key] = plan
        return plan


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Store this layer's new K/V in the pool and attend over the paged K/V.

    Parameters
    ----------
    module : torch.nn.Module
        The HF attention layer; ``module.layer_idx`` selects the pool tensors.
    query : torch.Tensor
        ``[1, Hq, T, D]`` after RoPE (all requests packed along ``T``).
    key, value : torch.Tensor
        ``[1, Hkv, T, D]`` for the same ``T`` tokens.
    attention_mask : torch.Tensor | None
        Ignored: causality and request boundaries come from the metadata.
    scaling : float, optional
        Softmax scale; defaults to ``module.scaling`` or ``D ** -0.5``.
    sliding_window : int, optional
        This layer's window (each query sees the last ``sliding_window`` positions, itself
        included); ``None`` or 0 for full attention.
    softcap : float, optional
        Attention logit soft-cap (Gemma 2).
    s_aux : torch.Tensor, optional
        ``[Hq]`` attention-sink logits (gpt-oss passes its ``sinks`` parameter under this name, as
        transformers' flash-attention kernels take it): they join the softmax denominator.
    **kwargs
        Must contain :data:`METADATA_KWARG`; everything else is ignored.

    Returns
    -------
    tuple[torch.Tensor, None]
        ``[1, T, Hq, D]`` attention output and no attention weights.
    """
    metadata = step_metadata(kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME} expects one packed sequence (batch dim 1), got {query.shape[0]}")
    layer_idx = int(module.layer_idx)  # type: ignore[arg-type]  # an int attribute of every HF attention layer
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    # Views, not copies: every kernel takes any strides with head_dim contiguous.
    out = paged_attention(
        metadata, layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        scaling=float(scaling), sliding_window=sliding_window, softcap=softcap, sinks=s_aux,
    )  # fmt: skip
    return out.unsqueeze(0), None


def step_metadata(kwargs: dict[str, Any]) -> PagedAttentionMetadata:
    """The step's metadata among an attention layer's keyword arguments; a clear error without it."""
    metadata: PagedAttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if metadata is None:
        raise RuntimeError(
            f"attention {ATTENTION_NAME!r} needs `{METADATA_KWARG}=` in the model call; "
            "run the model through ModelRunner.forward, not model.generate()"
        )
    return metadata


def paged_attention(
    metadata: PagedAttentionMetadata,
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    values_in_keys: bool = False,
) -> torch.Tensor:
    """Store layer ``layer_idx``'s new K/V (``[T, Hkv, D]``) in the pool and attend with ``q`` (``[T, Hq, D]``).

    The core shared by the HF hook (:func:`paged_attention_forward`) and the fused attention modules
    (:mod:`tgi_paged_backend.runner.cpu.fused_blocks`) and the ALiBi attention modules
    (:mod:`tgi_paged_backend.runner.families.alibi`, ``alibi_slopes``: fp32 ``[Hq]``) and the latent attention
    (:mod:`tgi_paged_backend.runner.families.mla`, ``values_in_keys``: ``v`` is the first ``Dv`` columns of ``k``,
    the pool holds one tensor, and the layer's value cache is the view of its first ``Dv`` columns). Returns
    ``[T, Hq, Dv]`` in ``q``'s dtype.
    """
    if metadata.seen_options is not None:
        metadata.seen_options.append(
            dict(scaling=float(scaling), sliding_window=int(sliding_window or 0) or None, softcap=float(softcap or 0.0),
                 sinks=sinks is not None, alibi=alibi_slopes is not None)
        )  # fmt: skip
    if metadata.layer_calls is not None:  # probe: which layers reach us, nothing computed
        metadata.layer_calls.append(layer_idx)
        return q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
    k_cache, v_cache = metadata.k_caches[layer_idx], metadata.v_caches[layer_idx]
    batch = metadata.batch
    slot_mapping, block_tables = metadata.tables(layer_idx)
    # MLA: one scale for the key and the value read from its columns, and the entry stored once (key only)
    v_scale = metadata.k_scale if values_in_keys else metadata.v_scale
    if values_in_keys:
        tgi_paged_kernels.store_kv(k, None, k_cache, None, slot_mapping, k_scale=metadata.k_scale)
    else:
        tgi_paged_kernels.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=metadata.k_scale, v_scale=v_scale)
    window = int(sliding_window) if sliding_window else None
    options: dict[str, Any] = dict(
        scale=scaling,
        softcap=float(softcap or 0.0),
        sliding_window=window,
        k_scale=metadata.k_scale,
        v_scale=v_scale,
        sinks=None if sinks is None else sinks.detach().float().contiguous(),
        alibi_slopes=alibi_slopes,
    )
    if batch.is_decode:
        # The native kernel reads the block tables as they are; the others share one plan per step.
        native = (
            metadata.cpu_decode == "native" and not metadata.static and alibi_slopes is None
            and native_decode_for(k_cache) is not None
        )  # fmt: skip
        gather = None if native else metadata.decode_gather(k_cache.shape[1], window, layer_idx)
        return tgi_paged_kernels.paged_decode_attention(
            q, k_cache, v_cache, block_tables, batch.seq_lens, gather=gather, cpu_kernel=metadata.cpu_decode,
            **options,
        )  # fmt: skip
    return tgi_paged_kernels.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, batch.query_start_loc, batch.seq_lens, new_kv=(k, v),
        attend_limits=batch.attend_limits, **options,
    )  # fmt: skip


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask builder for ``AttentionMaskInterface``: paged attention needs none."""
    return None


def register_attention() -> str:
    """Register :func:`paged_attention_forward` (and its no-op mask) with transformers; idempotent.

    Returns the name to pass as ``attn_implementation``.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    if _MaskInterface is not None:
        _MaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME


def mask_placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """``attention_mask`` to pass to the model: ``None``, or a ``[1, 1, 1, 1]`` zero mask before 4.53.

    transformers < 4.53 otherwise materializes a ``[1, 1, T, T]`` causal mask for custom attention
    functions; a 4D mask given by the caller is passed through as is (documented behaviour of
    ``_prepare_4d_causal_attention_mask_with_cache_position``), and we ignore it anyway.
    """
    if HAS_MASK_INTERFACE:
        return None
    return torch.zeros((1, 1, 1, 1), device=device, dtype=dtype)
