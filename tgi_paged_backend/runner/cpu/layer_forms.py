"""The :class:`~tgi_paged_kernels.LayerForm` of a transformers decoder layer made of the fused blocks.

A decoder layer is described as data for the native decode step (:mod:`.native_layers`): where its norms sit
(:data:`NORM_PLACES`, by layer class: Llama's two pre-norms, Gemma 2/3's sandwich of four, OLMo2's two
post-norms; OPT's and Falcon's by their config: :func:`layer_places`), and, read from the modules themselves,
each norm's kind (``w`` or Gemma's ``1 + w``, found by running the norm on a random input against both) and
epsilon, the q/k norms (per head or over all heads), the MLP's activation (SiLU, GeLU-tanh, GeLU or ReLU, found
the same way), the q/k/v bias, the attention's scale, window and soft-cap (what the fused attention's load-time
check recorded) and Granite's residual multiplier. A tensor-parallel rank's layer is described by its slices: its
heads and MLP columns, its o and down projections' linears over its input columns (:func:`row_parallel_part`; their
replicated biases are added after the all-reduce, which the native step leaves to its caller).

Nothing here is trusted: a layer is served natively only after :func:`..native.checks.reproduces` has shown
one decode step of the description gives the module's output and K/V.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tgi_paged_backend.lora.layers import lora_base
from tgi_paged_backend.runner.cpu.fast_layers import outputs_close, rms_norm_eps
from tgi_paged_backend.runner.cpu.fused_blocks import FusedGatedMLP, FusedPagedAttention
from tgi_paged_backend.runner.cpu.moe_forms import MoeParts, moe_parts
from tgi_paged_backend.runner.cpu.qkv_layouts import plain_linear
from tgi_paged_backend.runner.parallel.fused_parts import ReducedOutput
from tgi_paged_backend.runner.parallel.row_parallel import RowParallelLinear
from tgi_paged_backend.runner.quant.linear import Fp8Linear, IntLinear
from tgi_paged_kernels import LayerForm, LayerWeights, PackedInt8, pack_fp8, pack_int8, pack_int8_layer

_PLACES = ("attn_in", "attn_out", "mlp_in", "mlp_out")
_PRE = ("input_layernorm", None, "post_attention_layernorm", None)
_SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
NORM_PLACES: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    **dict.fromkeys(
        ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "GemmaDecoderLayer"),
        _PRE,
    ),
    "Phi3DecoderLayer": _PRE,  # its residual dropouts are the identity at inference
    "GraniteDecoderLayer": _PRE,  # h += residual_multiplier * block(norm(h))
    "Starcoder2DecoderLayer": _PRE,  # LayerNorms with bias, biases everywhere, ungated c_fc/c_proj MLP
    "Gemma2DecoderLayer": _SANDWICH,
    "Gemma3DecoderLayer": _SANDWICH,
    "Olmo2DecoderLayer": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
    # parallel: h += attn(x) + mlp(x), x = input_layernorm(h) (PARALLEL)
    "CohereDecoderLayer": ("input_layernorm", None, None, None),
    "PhiDecoderLayer": ("input_layernorm", None, None, None),  # resid_dropout: the identity at inference
    "GPTNeoXLayer": ("input_layernorm", None, "post_attention_layernorm", None),  # parallel: use_parallel_residual
    "GPTJBlock": ("ln_1", None, None, None),
    "Cohere2DecoderLayer": ("input_layernorm", None, None, None),
    "GPTBigCodeBlock": ("ln_1", None, "ln_2", None),  # LayerNorms with bias, ungated c_fc/c_proj MLP
    "GPT2Block": ("ln_1", None, "ln_2", None),  # the same, its Conv1D projections linearized at load
    "MixtralDecoderLayer": _PRE,  # MoE: router and experts in the native step (.moe_forms)
    "Qwen3MoeDecoderLayer": _PRE,
    "Qwen2MoeDecoderLayer": _PRE,  # MoE with a shared expert; its dense layers (mlp_only_layers) too
    "Qwen2VLDecoderLayer": _PRE,  # the VLMs' text layers: Qwen2's (M-RoPE is in the tables the model passes)
    "Qwen2_5_VLDecoderLayer": _PRE,
    "OPTDecoderLayer": ("self_attn_layer_norm", None, "final_layer_norm", None),  # per config: _configured_places
    "FalconDecoderLayer": ("input_layernorm", None, "post_attention_layernorm", None),  # per config: the same
}
"""Decoder layer classes of the form ``h += s * n_ao(attn(n_ai(h))); h += s * n_mo(mlp(n_mi(h)))``: the
attributes holding their norms before / after attention and before / after the MLP (``None``: no norm
there). Other classes keep the Python path."""

_UNGATED = (
    ("fc1", "fc2", "activation_fn"),
    ("dense_h_to_4h", "dense_4h_to_h", "act"),
    ("fc_in", "fc_out", "act"),
    ("c_fc", "c_proj", "act"),
)
"""Ungated MLPs' up and down projections and activation: Phi's, GPT-NeoX's, GPT-J's, StarCoder2's."""


def _configured_places(layer: nn.Module) -> tuple[tuple[str | None, ...], bool, bool] | None:
    """``(norm places, parallel, post_add_norms)`` of the classes whose form depends on their config (OPT's
    ``do_layer_norm_before``, Falcon's architecture flags), ``None`` for the others."""
    kind, config = type(layer).__name__, getattr(layer, "config", None)
    if kind == "OPTDecoderLayer" and not getattr(layer, "do_layer_norm_before", True):
        return (None, "self_attn_layer_norm", None, "final_layer_norm"), False, True  # OPT-350m: post-LN
    if kind == "FalconDecoderLayer" and config is not None:
        if hasattr(layer, "ln_attn"):  # new architecture with two norms: h += attn(ln_attn(h)) + mlp(ln_mlp(h))
            return ("ln_attn", None, "ln_mlp", None), True, False
        if config.new_decoder_architecture or config.parallel_attn:
            return ("input_layernorm", None, None, None), True, False
    return None


def layer_places(layer: nn.Module) -> tuple[tuple[str | None, ...], bool, bool] | None:
    """``(norm places, parallel, post_add_norms)`` of ``layer`` (:data:`NORM_PLACES`), ``None`` for a class
    without a layer form."""
    places = NORM_PLACES.get(type(layer).__name__)
    if places is None:
        return None
    configured = _configured_places(layer)
    if configured is not None:
        return configured
    parallel = bool(getattr(layer, "use_parallel_residual", type(layer).__name__ in PARALLEL))
    return places, parallel, False


def layer_mlp(layer: nn.Module) -> Any:
    """A decoder layer's MLP: its ``mlp`` (MPT's ``ffn``), or the layer itself when it holds the projections (OPT's
    fc1, fc2); a tensor-parallel rank's MoE block under its all-reduce (``ReducedOutput``), that block."""
    mlp = getattr(layer, "mlp", None) or getattr(layer, "ffn", None) or (layer if mlp_parts(layer) else None)
    return mlp.block if isinstance(mlp, ReducedOutput) else mlp


def mlp_parts(mlp: Any) -> tuple[str, str, str] | None:
    """The names of ``mlp``'s up (or gate/up), down projections and activation, ``None`` if we do not run it."""
    if isinstance(mlp, FusedGatedMLP):
        return "gate_up", "down_proj", "act_fn"
    return next((names for names in _UNGATED if all(hasattr(mlp, n) for n in names)), None)


def layer_attention(layer: nn.Module) -> Any:
    """A decoder layer's attention (``self_attn``; GPT-NeoX's ``attention``, GPT-J's ``attn``, Falcon's
    ``self_attention``)."""
    names = ("self_attn", "attention", "attn", "self_attention")
    return next((getattr(layer, n) for n in names if hasattr(layer, n)), None)


PARALLEL = frozenset({"CohereDecoderLayer", "Cohere2DecoderLayer", "PhiDecoderLayer", "GPTJBlock"})
"""Classes of :data:`NORM_PLACES` whose attention and MLP read the same normed input and add to ``h`` together."""

_ACTIVATIONS = {
    "silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "relu": F.relu,
}  # fmt: skip


def _eps(module: Any) -> float | None:
    """The epsilon of an RMSNorm, or of a LayerNorm-named module (Cohere's, ``nn.LayerNorm``)."""
    if not isinstance(module, nn.Module):
        return None
    if not type(module).__name__.endswith("LayerNorm"):
        return rms_norm_eps(module)
    found = [getattr(module, n, None) for n in ("variance_epsilon", "eps")]
    return next((eps for eps in found if isinstance(eps, float)), None)


def _norm(module: Any, width: int, kinds: tuple[str, ...] = ("rms", "rms_1p")) -> tuple[str, float, torch.Tensor] | str:
    """``(kind, eps, weight)`` of an RMSNorm (or LayerNorm, when ``kinds`` allow it; its bias: :func:`_bias`) over
    ``width`` fp32 values, or why it is not one we run."""
    eps = _eps(module)
    weight, bias = getattr(module, "weight", None), _bias(module)
    if eps is None or not isinstance(weight, torch.Tensor) or (bias is not None and "layer" not in kinds):
        return f"{type(module).__name__} is not an RMSNorm or a LayerNorm"
    if weight.dtype != torch.float32 or weight.shape != (width,):
        return f"{type(module).__name__} is not an fp32 RMSNorm over {width} values"
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y = module(x)
        for kind in kinds:
            w = 1.0 + weight.float() if kind == "rms_1p" else weight
            ref = F.layer_norm(x, (width,), w, bias, eps) if kind == "layer" else F.rms_norm(x, (width,), w, eps)
            if outputs_close(y, ref):
                return kind, eps, weight.detach()
    return f"{type(module).__name__} is none of {', '.join(kinds)}"


def _bias(module: Any) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias.detach() if isinstance(bias, torch.Tensor) else None


def _activation(act_fn: nn.Module) -> str | None:
    x = torch.linspace(-6.0, 6.0, 193)
    with torch.inference_mode():
        y = act_fn(x)
        return next((name for name, fn in _ACTIVATIONS.items() if outputs_close(y, fn(x))), None)


def _plain(linear: Any, bias: bool = False) -> bool:
    """An fp32 ``nn.Linear`` (or a subclass that only changes its forward: Falcon's), without bias unless ``bias``."""
    return plain_linear(linear) and linear.weight.dtype == torch.float32 and (bias or linear.bias is None)


def row_parallel_part(module: Any) -> tuple[Any, torch.Tensor | None, RowParallelLinear | None]:
    """``(linear, bias, row_parallel)`` of an output projection: the linear that computes this rank's part and
    the bias added to its output; for a tensor-parallel rank's :class:`RowParallelLinear`, its linear over the
    rank's input columns, the replicated bias added after the all-reduce, and the row-parallel module itself."""
    base = lora_base(module)
    if isinstance(base, RowParallelLinear):  # LoRA wraps its local linear (the adapter's A cut to its columns)
        return lora_base(base.local), base.bias, base
    return base, getattr(base, "bias", None), None


def _int8(linear: Any) -> PackedInt8 | None:
    """An :class:`IntLinear` of 8 bits and one group per output channel (per-channel scales), or an
    :class:`Fp8Linear` (one scale per output channel) without a NaN byte, packed for the native GEMM
    (:func:`~tgi_paged_kernels.pack_int8`, :func:`~tgi_paged_kernels.pack_fp8`); ``None`` for anything else."""
    if isinstance(linear, Fp8Linear) and linear.qweight.dtype == torch.float8_e4m3fn:
        try:
            return pack_fp8(linear.qweight, linear.weight_scale)
        except ValueError:  # a NaN byte: the per-op path dequantizes it as torch does
            return None
    if not isinstance(linear, IntLinear) or linear.bits != 8 or linear.scales.shape[1] != 1:
        return None
    return pack_int8(linear.codes(), linear.scales, linear.zeros)


def layer_form(layer: nn.Module) -> tuple[LayerForm, dict[str, Any]] | str:
    """The form of ``layer`` and its weights as :meth:`~tgi_paged_kernels.LayerWeights.pack` takes them, or
    why the native step cannot run it (one line, for the start-up log)."""
    found_places = layer_places(layer)
    attn, mlp = layer_attention(layer), layer_mlp(layer)
    if getattr(attn, "alibi_slopes", None) is not None:  # Bloom, MPT, Falcon-RW
        return "ALiBi position biases: the native decode attention takes no slopes"
    moe = moe_parts(mlp) if hasattr(mlp, "experts") else None  # Mixtral, Qwen2/3-MoE, gpt-oss
    if isinstance(moe, str):
        return f"MoE: {moe}"
    if found_places is None:
        return "no layer form for this class"
    places, parallel, post_add = found_places
    gated, names = isinstance(mlp, FusedGatedMLP) or moe is not None, mlp_parts(mlp)
    if not isinstance(attn, FusedPagedAttention) or (names is None and moe is None):
        return "its attention or MLP is not fused"
    found_mlp = _dense_mlp(mlp, cast(tuple[str, str, str], names)) if moe is None else _moe_mlp(moe)
    if isinstance(found_mlp, str):
        return found_mlp
    raw, mlp_bias, act_fn = found_mlp
    qkv = cast(nn.Linear, lora_base(attn.qkv_proj))
    o, o_bias, o_row_parallel = row_parallel_part(attn.o_proj)
    qkv_w: Any = _int8(qkv)  # int8 of one group per channel: dequantized in the native GEMM's tile
    o_w: Any = _int8(o)
    if qkv_w is None or o_w is None:
        if not (_plain(qkv, bias=True) and _plain(o, bias=True)):
            return "its projections are not plain fp32 linears (quantized, sliced or biased in part)"
        qkv_w, o_w = qkv.weight, o.weight
    if isinstance(raw["gate_up"], PackedInt8) != isinstance(qkv_w, PackedInt8):
        return "its projections are not all fp32 or all int8 / fp8 of one scale per channel"
    if moe is None:
        sharded_mlp = row_parallel_part(getattr(mlp, cast(tuple[str, str, str], names)[1]))[2] is not None
    else:  # a rank's MoE block: its slice of every expert, the block's output all-reduced
        sharded_mlp = isinstance(getattr(layer, "mlp", None), ReducedOutput)
    if (o_row_parallel is not None) != sharded_mlp:
        return "one of its o and down projections is row-parallel, the other not"
    hidden, hq, hkv, d = int(o.out_features), attn.num_q_heads, attn.num_kv_heads, attn.head_dim
    raw.update(qkv=qkv_w, qkv_bias=qkv.bias, o=o_w, o_bias=o_bias)
    layer_norms: list[tuple[str, float]] = []
    for place, attr in zip(_PLACES, places):
        if attr is None:
            continue
        found = _norm(getattr(layer, attr, None), hidden, ("rms", "rms_1p", "layer"))
        if isinstance(found, str):
            return f"{attr}: {found}"
        layer_norms.append(found[:2])
        raw[place], raw[f"{place}_bias"] = found[2], _bias(getattr(layer, attr))
    qk: list[tuple[str, float]] = []
    qk_norm = "none"
    if attn.q_norm is not None or attn.k_norm is not None:
        qk_norm = "all" if attn.qk_norm_over_heads else "head"
        widths = (hq * d, hkv * d) if qk_norm == "all" else (d, d)
        for name, module, width in zip(("q_norm", "k_norm"), (attn.q_norm, attn.k_norm), widths):
            found = _norm(module, width)
            if isinstance(found, str):
                return f"{name}: {found}"
            qk.append(found[:2])
            raw[name] = found[2]
    activation = _activation(act_fn)
    if activation is None or (not gated and activation == "silu"):
        return f"its MLP's activation {type(act_fn).__name__} is not SiLU (gated), GeLU or ReLU"
    norm_biases = {raw.get(f"{place}_bias") is not None for place, attr in zip(_PLACES, places) if attr}
    if len(set(layer_norms)) > 1 or len(set(qk)) > 1 or len(norm_biases) > 1:
        return "its norms differ in kind, epsilon or bias"
    (kind, eps), (qk_kind, qk_eps) = (layer_norms or [("rms", 1e-6)])[0], (qk or [("rms", 1e-6)])[0]
    rope = "interleaved" if attn.rope == "gptj" else attn.rope  # GPT-J's tables are read by the layer's wrapper
    form = LayerForm(
        scale=float(attn.scaling), norm=kind, eps=eps,
        attn_in_norm=places[0] is not None, attn_out_norm=places[1] is not None,
        mlp_in_norm=places[2] is not None, mlp_out_norm=places[3] is not None,
        qk_norm=qk_norm, qk_norm_kind=qk_kind, qk_eps=qk_eps, activation=activation,
        qkv_bias=qkv.bias is not None, softcap=float(attn.softcap or 0.0), window=int(attn.sliding_window or 0),
        residual_scale=float(cast(float, getattr(layer, "residual_multiplier", 1.0))),
        rope=rope, parallel=parallel, gated=gated, o_bias=o_bias is not None, mlp_bias=mlp_bias,
        rotary_dim=attn.rotary_dim if attn.rotary_dim < d else 0, norm_bias=True in norm_biases,
        post_add_norms=post_add, experts=0 if moe is None else int(moe.router.shape[0]),
        top_k=0 if moe is None else moe.top_k, norm_top_k=moe is not None and moe.norm_top_k,
        shared_expert=moe is not None and moe.shared is not None,
    )  # fmt: skip
    return form, raw


_MlpRaw = tuple[dict[str, Any], bool, nn.Module]
"""An MLP's weights as :meth:`~tgi_paged_kernels.LayerWeights.pack` takes them, whether it has biases, its
activation module."""


def _dense_mlp(mlp: Any, names: tuple[str, str, str]) -> _MlpRaw | str:
    up, down_name, act_name = names
    gate_up = cast(nn.Linear, lora_base(getattr(mlp, up)))
    down, down_bias, _ = row_parallel_part(getattr(mlp, down_name))
    act_fn = cast(nn.Module, getattr(mlp, act_name))
    gate_up_w, down_w = _int8(gate_up), _int8(down)
    if gate_up_w is not None and down_w is not None and (gate_up.bias is None) == (down_bias is None):
        int8 = dict(gate_up=gate_up_w, down=down_w, gate_up_bias=gate_up.bias, down_bias=down_bias)
        return int8, gate_up.bias is not None, act_fn
    mlp_bias = _plain(gate_up, bias=True) and gate_up.bias is not None
    if not (_plain(gate_up, mlp_bias) and _plain(down, mlp_bias)) or mlp_bias != (down_bias is not None):
        return "its projections are not plain fp32 linears (quantized, sliced or biased in part)"
    raw: dict[str, Any] = dict(gate_up=gate_up.weight, down=down.weight, gate_up_bias=gate_up.bias, down_bias=down_bias)
    return raw, mlp_bias, act_fn


def _moe_mlp(moe: MoeParts) -> _MlpRaw | str:
    raw: dict[str, Any] = dict(router=moe.router, gate_up=moe.gate_up, down=moe.down)
    if moe.shared is not None:
        raw.update(shared_gate_up=moe.shared[0], shared_down=moe.shared[1], shared_gate=moe.shared[2])
        if _activation(moe.shared[3]) != _activation(moe.act_fn):
            return "MoE: its shared expert's activation is not the experts'"
    return raw, False, moe.act_fn


def layer_weights(layer: nn.Module) -> LayerWeights | str:
    """The packed weights of ``layer``'s form (:func:`layer_form`), or why it has none."""
    found = layer_form(layer)
    if isinstance(found, str):
        return found
    form, raw = found
    attn = cast(FusedPagedAttention, layer_attention(layer))
    heads = dict(num_q_heads=attn.num_q_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim)
    int8 = {name: raw.pop(name) for name in ("qkv", "o", "gate_up", "down") if isinstance(raw.get(name), PackedInt8)}
    try:
        if int8:  # int8 (GPTQ, compressed-tensors) or fp8 projections of one scale per channel: dequantized in the tile
            return pack_int8_layer(form, raw, int8, **heads)
        return LayerWeights.pack(form, raw, **heads)
    except ValueError as e:  # weights that do not fit the form
        return str(e)
