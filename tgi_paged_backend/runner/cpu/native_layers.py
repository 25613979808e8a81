"""Decoder layers that run on the native CPU kernels (fp32 and bf16 models): a decode step as one call, for every
layer form.

After :func:`~runner.cpu.fused_blocks.fuse_blocks`, a decoder layer whose form :mod:`.layer_forms` can describe
(a class of :data:`~.layer_forms.NORM_PLACES` made of a :class:`~runner.cpu.fused_blocks.FusedPagedAttention`, a
:class:`~runner.cpu.fused_blocks.FusedGatedMLP` of SiLU or GeLU-tanh, RMSNorms of the ``w`` or ``1 + w`` kind,
LayerNorms, plain fp32 projections: Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Granite, OLMo2, Phi-3,
Cohere, Cohere 2, Phi, GPT-NeoX, GPT-J, StarCoder2 (parallel blocks, LayerNorms, partial or interleaved RoPE,
ungated MLPs), GPT-2, GPT-BigCode, OPT (learned positions: no RoPE; ReLU; OPT-350m's norms after the add) and
Falcon (parallel blocks with one or two LayerNorms, grouped or one KV head), Mixtral and Qwen3-MoE (an MoE MLP:
router, top-k, experts' GEMMs: :mod:`.moe_forms`)) is wrapped by :class:`NativeDecoderLayer`:

- a **decode step** (one new token per request, fp32 or bf16 pools) runs the whole layer through
  :func:`tgi_paged_kernels.cpu_layer.decode_layer`: one call and one OpenMP region instead of ~10
  calls, each with its Python, dispatch and thread wake-up;
- every other step (prefill, chunks, the static step, probes and checks) runs the wrapped layer, whose four
  projections are :class:`NativeLinear` (an MoE block's experts :class:`~.moe_forms.NativeExperts`) over the same
  packed weights (the native GEMM, as fast as oneDNN
  at every shape we measured): one copy of the weights, no extra memory.

Wrapped only after one decode step over scratch pools gives the original's output and K/V (to 1e-4: the
GEMM sums in another order than oneDNN/MKL): a description that is wrong is never served. A bf16 layer's
description is proven so on the layer widened to fp32, then its bf16 step (weights packed in bf16, fp32
arithmetic, bf16 hidden state) is checked against the module's bf16 step (:mod:`.native_bf16`).
``TGI_PAGED_NATIVE_LAYERS=0`` (``ModelConfig.native_layers``) keeps the per-op path. Figures:
``docs/performance.md``, "CPU forward".
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn

from tgi_paged_backend.lora.layers import find_lora_step, lora_base, replace_lora_base
from tgi_paged_backend.runner.attention import METADATA_KWARG, PagedAttentionMetadata
from tgi_paged_backend.runner.cpu.fast_layers import PackedLinear
from tgi_paged_backend.runner.cpu.fused_blocks import FusedPagedAttention, rope_table_width, rope_tables
from tgi_paged_backend.runner.cpu.layer_forms import NORM_PLACES, layer_attention, layer_form, layer_mlp, mlp_parts
from tgi_paged_backend.runner.cpu.moe_forms import NativeExperts
from tgi_paged_backend.runner.cpu.native_bf16 import bf16_step_close, fp32_params, projection_dtype
from tgi_paged_backend.runner.input_batch import build_forward_batch, on_consecutive_blocks
from tgi_paged_kernels import (
    LayerWeights,
    NativeKernels,
    decode_layer,
    gemm_packed,
    native_kernels,
)
from tgi_paged_kernels.cpu_gemm import unpack_weight

MAX_ROWS = 256
"""Decode batches up to this many requests run natively (scratch and tiles sized for decode)."""
BF16_MATMUL_ROWS = 32
"""From this many rows a bf16 :class:`NativeLinear` runs oneDNN's bf16 GEMM (AMX tiles or AVX512-BF16 where present)
on the module's weight in oneDNN's layout (:meth:`NativeLinear.keep_dense`, :class:`.fast_layers.PackedLinear`), as
the per-op path does: a SmolLM2 prefill of 565 tokens took 813 ms through the packed GEMM, 225 ms per op (Sapphire
Rapids, 2 threads). A bf16 model so holds its decoder projections twice in bf16: the bytes of one fp32 copy."""


def layer_weights(layer: nn.Module) -> LayerWeights | str:
    """The packed weights of ``layer``'s form (:func:`~.layer_forms.layer_form`), or why it has none."""
    found = layer_form(layer)
    if isinstance(found, str):
        return found
    form, raw = found
    attn = cast(FusedPagedAttention, layer_attention(layer))
    try:
        return LayerWeights.pack(
            form, raw, num_q_heads=attn.num_q_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim
        )
    except ValueError as e:  # weights that do not fit the form
        return str(e)


class NativeDecoderLayer(nn.Module):
    """A decoder layer whose decode steps run natively; every other step runs the wrapped ``layer``."""

    def __init__(self, layer: nn.Module, weights: LayerWeights, native: NativeKernels) -> None:
        super().__init__()
        self.layer = layer
        self.weights = weights
        self.native = native
        self.layer_idx = int(layer_attention(layer).layer_idx)
        self.rope = cast(FusedPagedAttention, layer_attention(layer)).rope
        """The attention's rotary kind: how the step's ``position_embeddings`` read (:func:`rope_tables`; ``none``:
        the model passes none, its positions are learned)."""
        self.channel = cast(FusedPagedAttention, layer_attention(layer)).channel
        """Falcon's layers pass no metadata down: the model call's, from our Falcon attention's channel."""
        self.lora_step = find_lora_step(layer)
        """The adapters' routing when the layer has LoRA wrappers: steps with adapter rows run the per-op path."""
        self.native_steps = 0
        """Decode steps this layer ran as one native call (the load-time check needs its step to be one)."""
        self.as_tuple = False
        """transformers before 4.54 returns ``(hidden,)`` from a decoder layer, later versions the tensor: set
        by the load-time check (:func:`_reproduces`) from what the wrapped layer returns."""

    def own_projections(self) -> None:
        """Make the packed weights the only copy: the wrapped layer's four projections become
        :class:`NativeLinear` views of them (prefills then run the native GEMM too)."""
        attn, mlp, w = cast(FusedPagedAttention, layer_attention(self.layer)), layer_mlp(self.layer), self.weights
        qkv_width = (w.num_q_heads + 2 * w.num_kv_heads) * w.head_dim
        h, q_width = w.hidden_size, w.num_q_heads * w.head_dim
        native: dict[tuple[nn.Module, str], nn.Module] = {
            (attn, "qkv_proj"): NativeLinear(w.qkv, qkv_width, w.qkv_bias, self.native, h),
            (attn, "o_proj"): NativeLinear(w.o, h, w.o_bias, self.native, q_width),
        }
        if w.form.experts:  # the experts' packed weights serve the other steps too (the router keeps its own)
            act_fn = cast(nn.Module, mlp.experts.act_fn)
            native[(mlp, "experts")] = NativeExperts(
                w.gate_up, w.down, w.form.experts, w.intermediate, act_fn, self.native
            )
            if w.shared_gate_up is not None and w.shared_down is not None:  # Qwen2-MoE's (fused) shared expert
                shared, width = mlp.shared_expert, w.shared_intermediate
                native[(shared, "gate_up")] = NativeLinear(w.shared_gate_up, 2 * width, None, self.native, h)
                native[(shared, "down_proj")] = NativeLinear(w.shared_down, h, None, self.native, width)
        else:
            up, down, _ = cast(tuple[str, str, str], mlp_parts(mlp))
            gate_up = NativeLinear(w.gate_up, (1 + w.form.gated) * w.intermediate, w.gate_up_bias, self.native, h)
            down_linear = NativeLinear(w.down, h, w.down_bias, self.native, w.intermediate)
            native.update({(mlp, up): gate_up, (mlp, down): down_linear})
        for (owner, name), linear in native.items():  # under any LoRA wrappers, which stay
            if isinstance(linear, NativeLinear) and w.weight_dtype == torch.bfloat16:  # prefills: torch's bf16 GEMM
                linear.keep_dense(cast(nn.Linear, lora_base(getattr(owner, name))))
            setattr(owner, name, replace_lora_base(getattr(owner, name), linear))

    def __getattr__(self, name: str) -> Any:
        """Attributes of the wrapped layer read through (``self_attn``, ``mlp``, ``attention_type``, ...)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def _native_step(self, hidden: torch.Tensor, kwargs: dict[str, Any]) -> PagedAttentionMetadata | None:
        metadata: PagedAttentionMetadata | None = kwargs.get(METADATA_KWARG)
        if metadata is None and self.channel is not None:
            metadata = self.channel.metadata
        if (
            metadata is None
            or not metadata.batch.is_decode
            or metadata.static
            or metadata.layer_calls is not None
            or metadata.seen_options is not None
            or metadata.k_scale != 1.0
            or metadata.v_scale != 1.0
            or hidden.shape[0] != 1
            or hidden.shape[1] > MAX_ROWS
            or metadata.cpu_decode != "native"  # TGI_PAGED_CPU_DECODE=compiled|sdpa: that kernel serves
            or (self.lora_step is not None and self.lora_step.token_slots is not None)  # LoRA rows: per-op path
            or torch.compiler.is_compiling()
        ):
            return None
        return metadata

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        metadata = self._native_step(hidden_states, kwargs)
        tables = kwargs.get("position_embeddings")
        if metadata is None or (tables is None and self.rope != "none"):
            return self.layer(hidden_states, *args, **kwargs)
        cos, sin = (None, None) if self.rope == "none" else rope_tables(tables, self.rope)
        if cos is not None and sin is not None and cos.dtype != hidden_states.dtype:  # the step takes them alike
            cos, sin = cos.to(hidden_states.dtype), sin.to(hidden_states.dtype)
        slot_mapping, block_tables = metadata.tables(self.layer_idx)
        out = decode_layer(
            self.native, self.weights, hidden_states[0], cos, sin,
            metadata.k_caches[self.layer_idx], metadata.v_caches[self.layer_idx],
            slot_mapping, block_tables, metadata.batch.seq_lens,
        )  # fmt: skip
        if out is None:  # inputs of another kind (slot dtype, RoPE table layout): the per-op path serves
            return self.layer(hidden_states, *args, **kwargs)
        self.native_steps += 1
        return (out.unsqueeze(0),) if self.as_tuple else out.unsqueeze(0)


class NativeLinear(nn.Module):
    """``x @ W.T (+ bias)`` through the native GEMM on ``W`` packed once (fp32 or bf16, :mod:`tgi_paged_kernels.
    cpu_gemm`), for any rows; a bf16 ``x`` is widened, the fp32 result rounded back to bf16, or from
    :data:`BF16_MATMUL_ROWS` rows, oneDNN's bf16 GEMM (:meth:`keep_dense`, as the per-op path computes it; the
    weight unpacked per call without it).

    Under ``torch.compile`` (the static step) it runs ``F.linear`` on an unpacked view instead."""

    def __init__(
        self, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, native: NativeKernels,
        in_features: int,
    ) -> None:  # fmt: skip
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.native = native
        self.resident_bytes = packed.numel() * packed.element_size()
        self.dense: PackedLinear | None = None

    def keep_dense(self, linear: nn.Linear) -> None:
        """Serve bf16 inputs of many rows by ``linear`` (the module's own, same weight and bias) in oneDNN's layout
        (its bytes count there, :attr:`.fast_layers.PackedLinear.resident_bytes`)."""
        self.dense = PackedLinear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        bf16_matmul = x.dtype == torch.bfloat16 and rows.shape[0] >= BF16_MATMUL_ROWS
        if bf16_matmul or torch.compiler.is_compiling() or x.dtype not in (torch.float32, torch.bfloat16):
            if self.dense is not None and bf16_matmul and not torch.compiler.is_compiling():
                return self.dense(x)
            weight = unpack_weight(self.packed, self.out_features, self.in_features)
            return F.linear(x, weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = gemm_packed(self.native, rows.float(), self.packed, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@dataclass(frozen=True, slots=True)
class NativeLayersReport:
    """What :func:`wrap_native_layers` wrapped (logged at start-up, asserted by the tests)."""

    wrapped: int
    kept: tuple[str, ...]
    """Why candidates kept their Python path (one line per distinct reason)."""


def _check_lengths(block_size: int) -> tuple[int, ...]:
    """Contexts of the check's decode step: within a block, across blocks, and past the tests' windows of 8."""
    return (5, block_size + 3, 2 * block_size, 3 * block_size + 5)


def _check_metadata(
    w: LayerWeights, layer_idx: int, block_size: int, dtype: torch.dtype = torch.float32, bf16_values: bool = False
) -> PagedAttentionMetadata:
    """A decode step of :func:`_check_lengths` requests over random pools of ``dtype`` (``bf16_values``: values
    rounded to bf16, whatever ``dtype`` holds them)."""
    lengths = _check_lengths(block_size)
    chunks, block = on_consecutive_blocks([([0], length - 1) for length in lengths], block_size)
    generator = torch.Generator().manual_seed(layer_idx)
    shape = (block, block_size, w.num_kv_heads, w.head_dim)
    values = [torch.randn(shape, generator=generator) for _ in range(2)]
    pools = [(v.bfloat16() if bf16_values else v).to(dtype) for v in values]
    layers = layer_idx + 1
    return PagedAttentionMetadata(build_forward_batch(chunks, block_size), [pools[0]] * layers, [pools[1]] * layers)


def _call(layer: nn.Module, channel: Any, x: torch.Tensor, tables: Any, metadata: PagedAttentionMetadata) -> Any:
    """``layer`` on one step as the model calls it: the metadata as a keyword and, for Falcon's layers (which pass
    none down), in the attention's channel; arguments the layer requires beyond these (Falcon's ``alibi``) None."""
    inner = layer.layer if isinstance(layer, NativeDecoderLayer) else layer
    given = {"position_embeddings": tables, "attention_mask": None, METADATA_KWARG: metadata}
    params = list(inspect.signature(inner.forward).parameters.values())[1:]
    required = [p.name for p in params if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    if channel is not None:
        channel.metadata = metadata
    try:
        return layer(x, **{name: None for name in required if name not in given}, **given)
    finally:
        if channel is not None:
            channel.metadata = None


def _reproduces(layer: nn.Module, wrapped: NativeDecoderLayer, block_size: int) -> bool:
    """Whether ``wrapped`` gives ``layer``'s output and K/V on one random decode step that it ran natively (it
    learns there whether the layer returns a tuple)."""
    w = wrapped.weights
    generator = torch.Generator().manual_seed(0)
    rows = len(_check_lengths(block_size))
    x = torch.randn(1, rows, w.hidden_size, generator=generator)
    table = rope_table_width(wrapped.rope, w.form.rotary_dim or w.head_dim)
    cos, sin = (torch.randn(1, rows, table, generator=generator) for _ in range(2))
    with torch.inference_mode():
        ref_meta = _check_metadata(w, wrapped.layer_idx, block_size)
        expected = _call(layer, wrapped.channel, x, (cos, sin), ref_meta)
        as_tuple = isinstance(expected, tuple)
        wrapped.as_tuple = as_tuple
        meta = _check_metadata(w, wrapped.layer_idx, block_size)
        steps = wrapped.native_steps
        got = _call(wrapped, wrapped.channel, x, (cos, sin), meta)
        if wrapped.native_steps == steps:  # the step fell back to the per-op path: nothing proven
            return False
    expected, got = (expected[0], got[0]) if as_tuple else (expected, got)
    close = all(
        a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4)
        for a, b in (
            (expected, got),
            (ref_meta.k_caches[-1], meta.k_caches[-1]),
            (ref_meta.v_caches[-1], meta.v_caches[-1]),
        )
    )
    return close


def _bf16_inputs(wrapped: NativeDecoderLayer, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The bf16 check's hidden state and RoPE tables: random values rounded to bf16, held in ``dtype``."""
    w, rows = wrapped.weights, len(_check_lengths(1))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, rows, w.hidden_size, generator=generator).bfloat16().to(dtype)
    table = rope_table_width(wrapped.rope, w.form.rotary_dim or w.head_dim)
    return x, tuple(torch.randn(1, rows, table, generator=generator).bfloat16().to(dtype) for _ in range(2))


def _bf16_step(
    layer: nn.Module, wrapped: NativeDecoderLayer, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer`` (or ``wrapped``) on the bf16 check's step in ``dtype`` over pools of ``kv_dtype``: its output and
    the K and V pools after it."""
    x, tables = _bf16_inputs(wrapped, dtype)
    meta = _check_metadata(wrapped.weights, wrapped.layer_idx, block_size, kv_dtype, bf16_values=True)
    with torch.inference_mode():
        out = _call(layer, wrapped.channel, x, tables, meta)
    out = out[0] if isinstance(out, tuple) else out
    return out, meta.k_caches[-1], meta.v_caches[-1]


def _reproduces_bf16(
    layer: nn.Module, wrapped: NativeDecoderLayer, block_size: int, kv_dtype: torch.dtype, exact: tuple
) -> bool:
    """Whether ``wrapped`` (bf16 weights) runs the bf16 check's step natively, as close to the fp32 module's
    results ``exact`` as the bf16 module's own step (:func:`.native_bf16.bf16_step_close`), output and K/V."""
    per_op = _bf16_step(layer, wrapped, block_size, torch.bfloat16, kv_dtype)
    steps = wrapped.native_steps
    native = _bf16_step(wrapped, wrapped, block_size, torch.bfloat16, kv_dtype)
    if wrapped.native_steps == steps:
        return False
    return all(bf16_step_close(*triple) for triple in zip(native, per_op, exact))


def _candidate(
    child: nn.Module, native: NativeKernels, block_size: int, kv_dtype: torch.dtype
) -> NativeDecoderLayer | str:
    """``child`` wrapped, its step proven (fp32: :func:`_reproduces`; bf16: the description on the layer widened to
    fp32, then :func:`_reproduces_bf16`), or why it keeps its Python path."""
    bf16 = projection_dtype(child) == torch.bfloat16
    with fp32_params(child) if bf16 else nullcontext():
        weights = layer_weights(child)
        if isinstance(weights, str):
            return weights
        candidate = NativeDecoderLayer(child, weights, native)
        if not _proven(_reproduces, child, candidate, block_size):
            return "its decode step differs"
        if not bf16:
            return candidate
        exact = _bf16_step(child, candidate, block_size, torch.float32, torch.float32)
    try:
        bf16_candidate = NativeDecoderLayer(child, weights.as_bf16(), native)
    except ValueError as e:
        return str(e)
    bf16_candidate.as_tuple = candidate.as_tuple
    if not _proven(_reproduces_bf16, child, bf16_candidate, block_size, kv_dtype, exact):
        return "its bf16 decode step differs"
    return bf16_candidate


def _proven(check: Any, layer: nn.Module, *args: Any) -> bool:
    """``check(layer, *args)``, any failure counting as not proven (logged at debug level)."""
    try:
        return bool(check(layer, *args))
    except Exception as e:  # noqa: BLE001 - any failure means: keep the Python path
        logger.debug("layer {} not native: {}: {}", type(layer).__name__, type(e).__name__, e)
        return False


def wrap_native_layers(model: nn.Module, block_size: int, kv_dtype: torch.dtype = torch.float32) -> NativeLayersReport:
    """Wrap the decoder layers of ``model`` whose form is described and reproduced (see the module docstring) in
    place, their checks over pools of ``kv_dtype``; other decoder layers are reported as kept, with the reason."""
    native = native_kernels()
    wrapped, kept = 0, set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            layer_like = kind.endswith(("DecoderLayer", "Block")) and (hasattr(child, "mlp") or hasattr(child, "ffn"))
            if isinstance(child, NativeDecoderLayer) or (kind not in NORM_PLACES and not layer_like):
                continue
            candidate = _candidate(child, native, block_size, kv_dtype) if native is not None else "no native kernels"
            if isinstance(candidate, str):
                kept.add(f"{kind}: {candidate}")
                continue
            candidate.own_projections()
            setattr(parent, name, candidate)
            wrapped += 1
    report = NativeLayersReport(wrapped=wrapped, kept=tuple(sorted(kept)))
    if wrapped or kept:
        logger.info("native decode layers: {} wrapped{}", wrapped, f"; kept: {'; '.join(report.kept)}" if kept else "")
    return report
