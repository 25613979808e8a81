"""Where an attention's checkpoint keeps its query, key and value rows, read into one all-q, all-k, all-v GEMM.

:class:`~.fused_blocks.FusedPagedAttention` computes q, k and v as one GEMM whose output rows are every query
head, then every key head, then every value head. Checkpoints lay them out in several ways
(:func:`qkv_layout`):

- separate ``q_proj``, ``k_proj``, ``v_proj`` (Llama and most families; OPT, with biases): stacked;
- one ``qkv_proj`` already in that order (Phi-3): taken as it is;
- one ``c_attn`` (GPT-2 after :func:`linearize_conv1d`; GPT-BigCode): all q, all k, all v, the key and value one
  head each under multi-query attention, taken as it is; GPT-BigCode without multi-query: per head its q, k, v;
- one ``query_key_value``: GPT-NeoX's per head q, k, v; our Falcon attention's
  (:class:`~tgi_paged_backend.runner.families.falcon.PagedFalconAttention`) in its variant's layout (per KV group
  its query heads then its key and value; multi-query: all queries, one key, one value; else per head).

A layout that needs its rows reordered becomes a new ``nn.Linear`` of the same weights in the other order (no LoRA
wrapper: its rows move); one taken as it is keeps its module (and any adapters). GPT-2's ``Conv1D`` (``x @ W + b``,
``W`` ``[in, out]``) is the ``nn.Linear`` of ``W`` transposed, converted once at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from tgi_paged_backend.lora.layers import lora_base, stack_with_lora
from tgi_paged_backend.runner.quant.linear import Fp8Linear, IntLinear, stacked_fp8_linear, stacked_int_linear


@dataclass(frozen=True, slots=True)
class QkvLayout:
    """An attention's q/k/v as one projection whose rows are all query heads, all key heads, all value heads."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    projection: nn.Module


def plain_linear(module: Any) -> bool:
    """An ``nn.Linear``, or a subclass that only changes the forward (transformers' ``FalconLinear``: matmul,
    then bias); LoRA wrappers are seen through (:func:`..lora.layers.lora_base`)."""
    base = lora_base(module)
    return isinstance(base, nn.Linear) and type(base).__init__ is nn.Linear.__init__


def stacked_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the outputs of ``parts`` side by side (all with a bias, or none)."""
    first = parts[0]
    has_bias = first.bias is not None
    fused = torch.nn.utils.skip_init(
        nn.Linear, first.in_features, sum(p.out_features for p in parts), bias=has_bias,
        device=first.weight.device, dtype=first.weight.dtype,
    )  # fmt: skip
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts if p.bias is not None]))
    fused.requires_grad_(False)
    return fused


def compute_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype ``module`` computes in: its first floating-point parameter's that is not fp8 (a projection's
    weight, an embedding; a quantized layer's norm or bias, its codes being buffers), ``None`` when it has none."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point() and p.element_size() > 1), None)


def linear_input(linear: Any, model_dtype: torch.dtype = torch.float32) -> tuple[int, torch.dtype, torch.device]:
    """``(in_features, dtype, device)`` of the input a projection takes (LoRA seen through): a plain linear's
    weight's; an int or fp8 linear dequantizes into the input's dtype: its bias's, else ``model_dtype`` (the
    dtype the model computes in)."""
    base = lora_base(linear)
    if isinstance(base, (Fp8Linear, IntLinear)):
        dtype = model_dtype if base.bias is None else base.bias.dtype
        return int(base.in_features), dtype, base.qweight.device
    weight = cast(nn.Linear, base).weight
    return int(weight.shape[1]), weight.dtype, weight.device


def _stack_bases(bases: list[nn.Module]) -> nn.Module:
    if all(isinstance(m, IntLinear) for m in bases):
        return stacked_int_linear(cast(list[IntLinear], bases))
    if all(isinstance(m, Fp8Linear) for m in bases):
        return stacked_fp8_linear(cast(list[Fp8Linear], bases))
    return stacked_linear(cast(list[nn.Linear], bases))


def stacked(parts: list[nn.Module]) -> nn.Module:
    """:func:`stacked_linear` of the parts' GEMMs (:func:`~..quant.linear.stacked_int_linear` for int linears,
    :func:`~..quant.linear.stacked_fp8_linear` for fp8 ones), each part's LoRA adapters (if any) kept on its
    columns."""
    return stack_with_lora(parts, _stack_bases)


def stackable(*linears: Any) -> bool:
    """Plain linears of one input width, all with a bias or all without (so one GEMM computes them); or int8 linears
    of one group per output channel (GPTQ, compressed-tensors), or fp8 e4m3 ones (one scale per output channel):
    what the native decode layer runs."""
    bases = [lora_base(m) for m in linears]
    same = len({m.in_features for m in bases}) == 1 and len({m.bias is None for m in bases}) == 1
    ints = [m for m in bases if isinstance(m, IntLinear) and m.bits == 8 and m.scales.shape[1] == 1]
    if ints and len(ints) == len(bases):  # the int8 layouts the native layer runs (one group per channel)
        return same
    fp8 = [m for m in bases if isinstance(m, Fp8Linear) and m.qweight.dtype == torch.float8_e4m3fn]
    if fp8 and len(fp8) == len(bases):
        return same
    return all(type(m) is nn.Linear for m in bases) and same


def _reordered(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A new ``nn.Linear`` whose output row ``i`` is ``linear``'s row ``rows[i]``."""
    fused = stacked_linear([linear])
    with torch.no_grad():
        fused.weight.copy_(linear.weight[rows])
        if linear.bias is not None:
            fused.bias.copy_(linear.bias[rows])
    return fused


def _per_head_rows(heads: int, head_dim: int) -> torch.Tensor:
    """Rows of a per-head ``(q, k, v)`` layout (GPT-NeoX, GPT-BigCode and Falcon without multi-query) in
    all-q, all-k, all-v order."""
    return torch.arange(3 * heads * head_dim).view(heads, 3, head_dim).transpose(0, 1).reshape(-1)


def _grouped_rows(kv_heads: int, group: int, head_dim: int) -> torch.Tensor:
    """Rows of Falcon's new-architecture layout (per KV head: its ``group`` query heads, its key, its value) in
    all-q, all-k, all-v order; query head ``h`` reads KV head ``h // group``, as the GQA kernels do."""
    index = torch.arange(kv_heads * (group + 2) * head_dim).view(kv_heads, group + 2, head_dim)
    return torch.cat((index[:, :group].reshape(-1), index[:, group].reshape(-1), index[:, group + 1].reshape(-1)))


def head_dim_of(attn: nn.Module) -> int:
    """The attention's head width (GPT-NeoX's ``head_size``)."""
    return int(getattr(attn, "head_dim", None) or attn.head_size)  # type: ignore[arg-type]


def _out_features(module: Any) -> int:
    return int(cast(nn.Linear, lora_base(module)).out_features)


def _falcon_layout(attn: Any, d: int) -> QkvLayout | None:
    qkv: nn.Linear = attn.query_key_value
    hq, hkv = int(attn.num_heads), int(attn.num_key_value_heads)
    if not plain_linear(qkv) or lora_base(qkv) is not qkv:
        return None
    if attn.new_decoder_architecture:
        rows = _grouped_rows(hkv, hq // hkv, d)
    elif attn.multi_query:
        rows = torch.arange(qkv.out_features)
    else:
        rows = _per_head_rows(hq, d)
    return QkvLayout(hq, hkv, d, _reordered(qkv, rows))


def _c_attn_layout(attn: Any, d: int) -> QkvLayout | None:
    c_attn: nn.Linear = attn.c_attn
    hq = int(attn.num_heads)
    if type(lora_base(c_attn)) is not nn.Linear or getattr(attn, "is_cross_attention", False):
        return None
    hkv = int(getattr(attn, "kv_heads", hq))
    if hasattr(attn, "multi_query") and not attn.multi_query:  # GPT-BigCode: per head (q, k, v)
        return QkvLayout(hq, hq, d, _reordered(c_attn, _per_head_rows(hq, d))) if lora_base(c_attn) is c_attn else None
    return QkvLayout(hq, hkv, d, c_attn)


def qkv_layout(attn: nn.Module) -> QkvLayout | None:
    """``attn``'s q/k/v as one all-q, all-k, all-v projection (see the module docstring); ``None`` for a layout
    not read here, or projections one GEMM cannot compute (quantized, sliced, of mixed biases)."""
    d = head_dim_of(attn)
    a: Any = attn
    if hasattr(a, "q_proj"):
        if not stackable(a.q_proj, a.k_proj, a.v_proj):
            return None
        hq, hkv = _out_features(a.q_proj) // d, _out_features(a.k_proj) // d
        return QkvLayout(hq, hkv, d, stacked([a.q_proj, a.k_proj, a.v_proj]))
    if hasattr(a, "c_attn"):
        return _c_attn_layout(a, d)
    if hasattr(a, "query_key_value") and hasattr(a, "new_decoder_architecture"):
        return _falcon_layout(a, d)
    if hasattr(a, "query_key_value"):  # GPT-NeoX: per head (q, k, v); no LoRA wrapper (its rows move)
        if type(a.query_key_value) is not nn.Linear:
            return None
        heads = _out_features(a.query_key_value) // (3 * d)
        return QkvLayout(heads, heads, d, _reordered(a.query_key_value, _per_head_rows(heads, d)))
    if hasattr(a, "qkv_proj") and hasattr(a, "num_key_value_heads") and type(lora_base(a.qkv_proj)) is nn.Linear:
        kv_heads = int(a.num_key_value_heads)
        return QkvLayout(_out_features(a.qkv_proj) // d - 2 * kv_heads, kv_heads, d, a.qkv_proj)
    return None


def output_projection(attn: nn.Module) -> nn.Module:
    """The attention's output projection (``o_proj``; ``dense``, ``out_proj``, ``c_proj``)."""
    names = ("o_proj", "dense", "out_proj", "c_proj")
    return cast(nn.Module, next(getattr(attn, n) for n in names if getattr(attn, n, None) is not None))


def linearize_conv1d(module: nn.Module) -> int:
    """Replace every transformers ``Conv1D`` under ``module`` (``y = x @ W + b``, ``W`` ``[in, out]``) by the
    ``nn.Linear`` holding ``W`` transposed (packed like any linear after); returns how many were replaced."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            weight = getattr(child, "weight", None)
            if type(child).__name__ != "Conv1D" or not isinstance(weight, torch.Tensor):
                continue
            bias = getattr(child, "bias", None)
            linear = nn.Linear(int(weight.shape[0]), int(weight.shape[1]), bias=bias is not None)
            linear.weight = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
            if isinstance(bias, torch.Tensor):
                linear.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
            setattr(parent, name, linear.to(weight.device))
            replaced += 1
    return replaced
