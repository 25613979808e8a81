"""Megatron-style slicing of transformers decoder layers for tensor parallelism (the layouts of
``docs/tensor-parallel.md``): column-parallel projections keep their output rows, row-parallel ones their
input columns with one all-reduce, fused projections each part's share (:mod:`.fused_parts`), MoE blocks their
experts' intermediate share, fewer KV heads than ranks are replicated, and q/k norms over all heads (OLMo2)
keep their slice of the weight with the sum of squares all-reduced (:mod:`.head_norm`). :mod:`.tp_runner` holds the
runner that loads, slices and serves a shard.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from tgi_paged_backend.runner.cpu.qkv_layouts import linearize_conv1d
from tgi_paged_backend.runner.families.mla import PagedLatentAttention
from tgi_paged_backend.runner.model.loader import ModelLoadError
from tgi_paged_backend.runner.model.spec import ModelSpec
from tgi_paged_backend.runner.model.vlm_loading import text_model
from tgi_paged_backend.runner.parallel.fused_parts import (
    ReducedOutput,
    shard_experts,
    shard_fused_linear,
    take_rows,
)
from tgi_paged_backend.runner.parallel.head_norm import shard_all_heads_norm
from tgi_paged_backend.runner.parallel.head_tensors import shard_head_tensors
from tgi_paged_backend.runner.parallel.row_parallel import AllReduce, row_parallel
from tgi_paged_backend.runner.quant.linear import QUANTIZED_LINEARS, QuantizedLinear


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What one rank holds after :func:`shard_model`."""

    rank: int
    world_size: int
    num_q_heads: int
    """Local query heads (``Hq / N``)."""
    num_kv_heads: int
    """Local KV heads (``Hkv / N``): what this rank's KV pool stores."""
    intermediate_size: int
    """Local MLP width (``I / N``)."""
    num_layers: int


def check_divisible(spec: ModelSpec, world_size: int) -> None:
    """Raise :class:`ModelLoadError` unless heads and MLP width split evenly over ``world_size`` ranks."""
    problems = [
        f"{name}={value}"
        for name, value in (
            ("num_attention_heads", spec.num_q_heads),
            ("intermediate_size", spec.intermediate_size),
        )
        if value % world_size
    ]
    if spec.num_kv_heads % world_size and world_size % spec.num_kv_heads:  # fewer KV heads than ranks: replicated
        problems.append(f"num_key_value_heads={spec.num_kv_heads}")
    if problems:
        raise ModelLoadError(
            f"cannot shard {spec.model_type} over {world_size} ranks: {', '.join(problems)} not divisible by "
            f"{world_size} (tensor parallelism splits attention heads and the MLP evenly, and KV heads evenly or "
            "replicated when there are fewer than ranks); use a "
            "--num-shard that divides them, or --num-shard 1"
        )


def _kv_rows(spec: ModelSpec, rank: int, world_size: int) -> slice:
    """This rank's rows of a K (or V) projection: its share of the KV heads, or, with fewer KV heads than ranks,
    the one head its query heads read (replicated on ``world_size / num_kv_heads`` ranks)."""
    kv, d = spec.num_kv_heads, spec.head_dim
    if kv >= world_size:
        local = kv // world_size
        return slice(rank * local * d, (rank + 1) * local * d)
    head = rank * kv // world_size
    return slice(head * d, (head + 1) * d)


def _shift(rows: slice, offset: int) -> slice:
    return slice(rows.start + offset, rows.stop + offset)


def _shard_columns(linear: nn.Linear | QuantizedLinear, rank: int, world_size: int, what: str) -> nn.Module:
    """This rank's contiguous slice of the output features (weight rows, their scales/zeros, bias)."""
    if linear.out_features % world_size:
        raise ModelLoadError(f"{what}: out_features={linear.out_features} not divisible by {world_size}")
    width = linear.out_features // world_size
    return _take_output_rows(linear, slice(rank * width, (rank + 1) * width))


def _take_output_rows(linear: nn.Linear | QuantizedLinear, rows: slice) -> nn.Module:
    """``linear`` cut to the output features ``rows`` (weight rows, their scales/zeros, bias)."""
    width = rows.stop - rows.start
    if isinstance(linear, QUANTIZED_LINEARS):
        sharded = linear.output_slice(rows)
        sharded.shard_out_rows = rows  # type: ignore[assignment]  # the unsharded layer's outputs this rank computes (LoRA cuts B to them)
        return sharded
    linear.shard_out_rows = rows  # type: ignore[assignment]
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = width
    return linear


def _linear(module: nn.Module, name: str, where: str) -> nn.Linear | QuantizedLinear:
    layer = getattr(module, name, None)
    if not isinstance(layer, (nn.Linear, *QUANTIZED_LINEARS)):
        raise ModelLoadError(
            "tensor parallelism does not split this layout (projections other than those docs/tensor-parallel.md "
            f"lists); {where} has no nn.Linear {name!r}: use --num-shard 1"
        )
    return layer


def _shard_cross_head_norms(
    attn: nn.Module,
    head_dim: int,
    rows: dict[str, tuple[slice, int]],
    world_size: int,
    all_reduce: AllReduce,
    where: str,
) -> None:
    """q/k norms over all heads at once (OLMo2) become this rank's :class:`.head_norm.AllHeadsNormShard` (its
    slice of the weight, the sum of squares all-reduced); per-head ones (Qwen3) run on a head shard as they are.
    ``rows``: per norm, this rank's output rows of its projection and the projection's full width."""
    for name, (local, full) in rows.items():
        norm = getattr(attn, name, None)
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.numel() == head_dim:
            continue
        if weight.numel() != full:
            raise ModelLoadError(
                f"tensor parallelism: {where}.{name} normalizes {weight.numel()} features, neither one head "
                f"({head_dim}) nor all of its projection ({full}): use --num-shard 1"
            )
        shard = shard_all_heads_norm(cast(nn.Module, norm), local, world_size, all_reduce, f"{where}.{name}")
        setattr(attn, name, shard)


def _localize_config(attn: nn.Module, q_local: int, kv_local: int) -> None:
    """Give ``attn`` a config of its own with this rank's head counts (Phi-3 splits its fused q/k/v output by
    ``config.num_attention_heads``); the model's shared config keeps the full counts."""
    config = getattr(attn, "config", None)
    if config is not None:
        local = copy.copy(config)
        local.num_attention_heads, local.num_key_value_heads = q_local, kv_local
        attn.config = local


def _shard_falcon_qkv(attn: nn.Module, spec: ModelSpec, rank: int, world_size: int, where: str) -> nn.Module:
    """This rank's rows of Falcon's fused ``query_key_value``, laid out as the full one for the local heads.

    New architecture: per KV group its query heads, its key, its value; whole groups per rank, or, with fewer
    groups than ranks, the rank's query heads of its group beside the group's key and value. Old architecture
    with ``multi_query``: the rank's query heads, then the one key and value (every rank). Without: per head
    q, k, v, so the rank's heads are one run of rows."""
    d, heads, kv = spec.head_dim, spec.num_q_heads, spec.num_kv_heads
    q_local = heads // world_size
    linear = _linear(attn, "query_key_value", f"{where}.self_attention")
    if not attn.new_decoder_architecture and not attn.multi_query:
        return _shard_columns(linear, rank, world_size, f"{where}.query_key_value")
    if attn.new_decoder_architecture and kv >= world_size:
        return _shard_columns(linear, rank, world_size, f"{where}.query_key_value")
    if attn.new_decoder_architecture:
        group = heads // kv
        kv_head = rank * kv // world_size
        start = kv_head * (group + 2) * d
        q_start = start + (rank * q_local - kv_head * group) * d
        parts = [slice(q_start, q_start + q_local * d), slice(start + group * d, start + (group + 2) * d)]
    else:
        parts = [slice(rank * q_local * d, (rank + 1) * q_local * d), slice(heads * d, (heads + 2) * d)]
    return take_rows(linear, parts, f"{where}.query_key_value")


def _shard_mlp(mlp: nn.Module, spec: ModelSpec, rank: int, world_size: int, all_reduce: AllReduce, where: str) -> None:
    """Column-parallel up projections, a row-parallel down projection, for the MLP layouts served:
    gate/up/down (Llama), one fused gate_up (Phi-3: each rank its share of gate and of up), c_fc/c_proj
    (StarCoder2's plain MLP), fc1/fc2 (Phi's)."""
    up: tuple[str, ...]
    if hasattr(mlp, "gate_up_proj"):
        size = spec.intermediate_size
        mlp.gate_up_proj = shard_fused_linear(
            cast(nn.Module, mlp.gate_up_proj), (size, size), rank, world_size, f"{where}.gate_up_proj"
        )
        up, down = (), "down_proj"
    elif hasattr(mlp, "c_fc") and hasattr(mlp, "c_proj"):
        up, down = ("c_fc",), "c_proj"
    elif hasattr(mlp, "fc1") and hasattr(mlp, "fc2"):  # Phi's plain MLP, OPT's (on the layer itself)
        up, down = ("fc1",), "fc2"
    elif hasattr(mlp, "fc_in") and hasattr(mlp, "fc_out"):  # GPT-J
        up, down = ("fc_in",), "fc_out"
    elif hasattr(mlp, "dense_h_to_4h") and hasattr(mlp, "dense_4h_to_h"):  # GPT-NeoX, Bloom, Falcon
        up, down = ("dense_h_to_4h",), "dense_4h_to_h"
    elif hasattr(mlp, "up_proj") and not hasattr(mlp, "gate_proj"):  # MPT: up_proj, down_proj
        up, down = ("up_proj",), "down_proj"
    else:
        up, down = ("gate_proj", "up_proj"), "down_proj"
    for name in up:
        setattr(mlp, name, _shard_columns(_linear(mlp, name, where), rank, world_size, f"{where}.{name}"))
    setattr(mlp, down, row_parallel(_linear(mlp, down, where), rank, world_size, all_reduce))


def _shard_moe(block: nn.Module, rank: int, world_size: int, all_reduce: AllReduce, where: str) -> nn.Module:
    """A MoE block sharded as stock TGI and vLLM do by default: every expert's intermediate dimension split
    across the ranks (:func:`.fused_parts.shard_experts`), the router replicated, a shared expert (Qwen2-MoE)
    (Qwen2-MoE's, DeepSeek's) split the same way with its down projection left unreduced, and one all-reduce of the
    block's output
    (the shared expert's sigmoid gate is replicated, so it scales each rank's part alike)."""
    shard_experts(cast(nn.Module, block.experts), rank, world_size, f"{where}.experts")
    shared = getattr(block, "shared_expert", None)  # Qwen2-MoE's; DeepSeek's is named shared_experts
    shared = getattr(block, "shared_experts", None) if shared is None else shared
    if shared is not None:
        for name in ("gate_proj", "up_proj"):
            setattr(
                shared,
                name,
                _shard_columns(_linear(shared, name, where), rank, world_size, f"{where}.shared_expert.{name}"),
            )
        down = _linear(shared, "down_proj", where)
        if down.bias is not None:
            raise ModelLoadError(f"tensor parallelism: {where}.shared_expert.down_proj has a bias: use --num-shard 1")
        shared.down_proj = row_parallel(down, rank, world_size, lambda t: t)  # reduced with the block's output
        shared.down_proj.reduced_with_block = True  # what the native MoE step reads (runner/cpu/moe_forms.py)
    return ReducedOutput(block, all_reduce)


ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
"""What decoder layers call their attention (Llama and most: self_attn; GPT-J: attn; GPT-NeoX: attention;
Falcon: self_attention)."""


def _attention(layer: nn.Module) -> nn.Module | None:
    for name in ATTENTION_NAMES:
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


def _mlp_owner(layer: nn.Module) -> nn.Module | None:
    """The module holding the MLP's projections: ``layer.mlp`` (MPT: ``layer.ffn``), or the layer itself (OPT's
    fc1/fc2)."""
    for name in ("mlp", "ffn"):
        mlp = getattr(layer, name, None)
        if isinstance(mlp, nn.Module):
            return mlp
    return layer if isinstance(getattr(layer, "fc1", None), nn.Module) else None


def _decoder_layers(model: nn.Module) -> list[nn.Module]:  # a VLM's: its language model's (text_model)
    root = text_model(model)
    return [m for m in root.modules() if _attention(m) is not None and _mlp_owner(m) is not None]


def shard_model(model: nn.Module, spec: ModelSpec, rank: int, world_size: int, all_reduce: AllReduce) -> ShardLayout:
    """Slice every decoder layer of ``model`` (in place) to rank ``rank`` of ``world_size``."""
    for module in model.modules():  # modules that say why they cannot be sliced
        reason = getattr(type(module), "tensor_parallel_refusal", None)
        if isinstance(reason, str):
            raise ModelLoadError(f"tensor parallelism: {reason}: use --num-shard 1")
    check_divisible(spec, world_size)
    layers = _decoder_layers(model)
    if len(layers) != spec.num_layers:
        raise ModelLoadError(
            f"tensor parallelism: found {len(layers)} decoder layers with self_attn and mlp, "
            f"expected {spec.num_layers} ({spec.model_type} is not supported): use --num-shard 1"
        )
    q_local, kv_local = spec.num_q_heads // world_size, max(spec.num_kv_heads // world_size, 1)
    kv_rows = _kv_rows(spec, rank, world_size)
    for i, layer in enumerate(layers):
        # _decoder_layers kept the modules that have both; transformers' decoder layers hold them as submodules.
        attn, mlp = cast(nn.Module, _attention(layer)), cast(nn.Module, _mlp_owner(layer))
        where = f"layer {i}"
        head_dim = getattr(attn, "head_dim", spec.head_dim)
        if head_dim != spec.head_dim:
            raise ModelLoadError(f"tensor parallelism: {where} has head_dim={head_dim}, expected {spec.head_dim}")
        linearize_conv1d(layer)  # GPT-2's Conv1D projections as the nn.Linear they are (weight transposed)
        q_rows, kv_all = spec.num_q_heads * head_dim, spec.num_kv_heads * head_dim
        q_part = slice(rank * q_rows // world_size, (rank + 1) * q_rows // world_size)
        if isinstance(attn, PagedLatentAttention):  # runner/families/mla.py: heads split, the latent whole
            name = "q_proj" if attn.q_proj is not None else "q_b_proj"  # the query's rows, head by head
            setattr(
                attn, name, _shard_columns(_linear(attn, name, where), rank, world_size, f"{where}.self_attn.{name}")
            )
            attn.keep_heads(rank, world_size)
        elif hasattr(attn, "new_decoder_architecture"):  # Falcon (runner/families/falcon.py): its variant's layout
            attn.query_key_value = _shard_falcon_qkv(attn, spec, rank, world_size, where)
        elif getattr(attn, "multi_query", False):  # GPT-BigCode: [q; k; v] with one KV head, kept by every rank
            attn.c_attn = take_rows(
                cast(nn.Module, attn.c_attn), [q_part, _shift(kv_rows, q_rows), _shift(kv_rows, q_rows + kv_all)],
                f"{where}.attn.c_attn",
            )  # fmt: skip
            attn.embed_dim = q_rows // world_size  # type: ignore[assignment]
        elif hasattr(attn, "multi_query"):  # GPT-BigCode without MQA: per head [q; k; v], heads contiguous
            attn.c_attn = _shard_columns(_linear(attn, "c_attn", where), rank, world_size, f"{where}.attn.c_attn")
            attn.embed_dim = q_rows // world_size  # type: ignore[assignment]
        elif hasattr(attn, "c_attn") and isinstance(getattr(attn, "split_size", None), int):  # GPT-2: [q; k; v]
            q_rows = spec.num_q_heads * head_dim
            attn.c_attn = shard_fused_linear(
                cast(nn.Module, attn.c_attn), (q_rows,) * 3, rank, world_size, f"{where}.attn.c_attn"
            )
            attn.split_size = q_rows // world_size  # type: ignore[assignment]
            attn.embed_dim = q_rows // world_size  # type: ignore[assignment]
        elif not hasattr(attn, "q_proj") and hasattr(attn, "qkv_proj"):  # Phi-3: q, k, v in one GEMM
            attn.qkv_proj = take_rows(
                cast(nn.Module, attn.qkv_proj),
                [q_part, _shift(kv_rows, q_rows), _shift(kv_rows, q_rows + kv_all)],
                f"{where}.self_attn.qkv_proj",
            )
            _localize_config(attn, q_local, kv_local)
        elif hasattr(attn, "Wqkv"):  # MPT: [q; k; v] blocks
            attn.Wqkv = take_rows(
                cast(nn.Module, attn.Wqkv), [q_part, _shift(kv_rows, q_rows), _shift(kv_rows, q_rows + kv_all)],
                f"{where}.attn.Wqkv",
            )  # fmt: skip
        elif hasattr(attn, "query_key_value"):  # GPT-NeoX, Bloom: per head [q; k; v], heads are contiguous row runs
            attn.query_key_value = _shard_columns(
                _linear(attn, "query_key_value", f"{where}.attention"), rank, world_size, f"{where}.query_key_value"
            )
        else:
            attn.q_proj = _shard_columns(_linear(attn, "q_proj", where), rank, world_size, f"{where}.self_attn.q_proj")
            for name in ("k_proj", "v_proj"):  # this rank's KV heads, or its one replicated head
                setattr(attn, name, _take_output_rows(_linear(attn, name, where), kv_rows))
        norm_rows = {"q_norm": (q_part, q_rows), "k_norm": (kv_rows, kv_all)}
        _shard_cross_head_norms(attn, head_dim, norm_rows, world_size, all_reduce, f"{where}.self_attn")
        shard_head_tensors(attn, spec.num_q_heads, rank, world_size, f"{where}.self_attn")  # sinks, ALiBi slopes
        out_name = next(  # Phi/NeoX: dense, GPT-J/OPT: out_proj, GPT-2: c_proj
            (n for n in ("o_proj", "dense", "out_proj", "c_proj") if hasattr(attn, n)), "o_proj"
        )
        setattr(
            attn, out_name, row_parallel(_linear(attn, out_name, f"{where}.self_attn"), rank, world_size, all_reduce)
        )
        # Some versions/families keep head counts on the module; the forward reshapes with -1, but
        # keep them truthful for anything that reads them.
        for attr, local in (
            ("num_heads", q_local),
            ("num_attention_heads", q_local),
            ("num_key_value_heads", kv_local),
        ):
            if isinstance(getattr(attn, attr, None), int):
                setattr(attn, attr, local)
        if hasattr(mlp, "experts"):
            layer.mlp = _shard_moe(mlp, rank, world_size, all_reduce, f"{where}.mlp")
        else:
            _shard_mlp(mlp, spec, rank, world_size, all_reduce, f"{where}.mlp")
        if isinstance(getattr(mlp, "intermediate_size", None), int):
            # torch types Module.__setattr__'s value as Tensor | Module, but it stores any other value
            # (this int) as a plain attribute.
            mlp.intermediate_size = spec.intermediate_size // world_size  # type: ignore[assignment]
    return ShardLayout(
        rank=rank,
        world_size=world_size,
        num_q_heads=q_local,
        num_kv_heads=kv_local,
        intermediate_size=spec.intermediate_size // world_size,
        num_layers=len(layers),
    )


def local_spec(spec: ModelSpec, layout: ShardLayout) -> ModelSpec:
    """The sizes one rank's KV pool and kernels see: local heads and MLP width, the same head_dim."""
    return dataclasses.replace(
        spec,
        num_q_heads=layout.num_q_heads,
        num_kv_heads=layout.num_kv_heads,
        intermediate_size=layout.intermediate_size,
    )
