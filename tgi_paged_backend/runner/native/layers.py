"""Decoder layers that run on the native CPU kernels (fp32 and bf16 models): a decode step as one call, for every
layer form.

After :func:`~runner.cpu.fused_blocks.fuse_blocks`, a decoder layer whose form :mod:`~..cpu.layer_forms` can describe
(a class of :data:`~..cpu.layer_forms.NORM_PLACES` made of a :class:`~runner.cpu.fused_blocks.FusedPagedAttention`, a
:class:`~runner.cpu.fused_blocks.FusedGatedMLP` of SiLU or GeLU-tanh, RMSNorms of the ``w`` or ``1 + w`` kind,
LayerNorms, plain fp32 projections: Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Granite, OLMo2, Phi-3,
Cohere, Cohere 2, Phi, GPT-NeoX, GPT-J, StarCoder2 (parallel blocks, LayerNorms, partial or interleaved RoPE,
ungated MLPs), GPT-2, GPT-BigCode, OPT (learned positions: no RoPE; ReLU; OPT-350m's norms after the add) and
Falcon (parallel blocks with one or two LayerNorms, grouped or one KV head), Mixtral and Qwen3-MoE (an MoE MLP:
router, top-k, experts' GEMMs: :mod:`~..cpu.moe_forms`)) is wrapped by :class:`NativeDecoderLayer`:

- a **decode step** (one new token per request, fp32 or bf16 pools) runs the whole layer through
  :func:`tgi_paged_kernels.cpu_layer.decode_layer`: one call and one OpenMP region instead of ~10
  calls, each with its Python, dispatch and thread wake-up; so does a **speculative verify step** (a few query
  rows per request that already has context: :data:`MAX_QUERY_ROWS`) and a step whose rows use **LoRA adapters**
  (each row's delta added inside the call, :mod:`.lora`);
- every other step (prefill, chunks, the static step, probes and checks) runs the wrapped layer, whose four
  projections are :class:`NativeLinear` (an MoE block's experts :class:`~..cpu.moe_forms.NativeExperts`) over the same
  packed weights (the native GEMM, as fast as oneDNN
  at every shape we measured): one copy of the weights, no extra memory.

A **tensor-parallel rank**'s layer (its slices: its heads, its MLP columns, its row-parallel o and down over its
input columns) is wrapped the same way; its decode step is native calls between the all-reduces of o's and down's
partial sums (:func:`tgi_paged_kernels.decode_layer_parts`: two all-reduces, one for a parallel block), which run
in Python through the row-parallel module's own all-reduce. Its prefills keep the row-parallel modules, their
local linears native. Each rank checks its own slices with the all-reduces as the identity (no collective in the
check), then the ranks agree (one all-gather): a layer is wrapped only where every rank's check passed, since a
native rank and a per-op rank would make different all-reduces. An MoE block (sharded: each rank its slice of
every expert, the router replicated, the block's output all-reduced) takes the place of the MLP's down; OLMo2's
q/k norms over all heads (an all-reduce inside the norm) keep the per-op path under TP, as do a rank's verify
steps and adapter rows.

Wrapped only after one decode step over scratch pools gives the original's output and K/V (to 1e-4, or 2e-5 of the
result's scale where that is larger: the GEMM sums in another order than oneDNN/MKL; :func:`.checks.fp32_close`),
and a prefill through the native projections gives the original's (:func:`.checks.own_proven`): a description that
is wrong is never served. A bf16 layer's
description is proven so on the layer widened to fp32, then its bf16 step (weights packed in bf16, fp32
arithmetic, bf16 hidden state) is checked against the module's bf16 step (:mod:`.checks`).
``TGI_PAGED_NATIVE_LAYERS=0`` (``ModelConfig.native_layers``) keeps the per-op path. Figures:
``docs/performance-cpu.md``, "CPU forward".
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from loguru import logger
from torch import nn

from tgi_paged_backend.lora.layers import find_lora_step, lora_base, replace_lora_base
from tgi_paged_backend.runner.attention import METADATA_KWARG, PagedAttentionMetadata
from tgi_paged_backend.runner.cpu.fast_layers import NativeInt8Linear, NativeLinear
from tgi_paged_backend.runner.cpu.fused_blocks import FusedPagedAttention, rope_tables
from tgi_paged_backend.runner.cpu.layer_forms import (
    NORM_PLACES,
    layer_attention,
    layer_mlp,
    layer_weights,
    mlp_parts,
    row_parallel_part,
)
from tgi_paged_backend.runner.cpu.moe_forms import NativeExperts
from tgi_paged_backend.runner.cpu.qkv_layouts import compute_dtype
from tgi_paged_backend.runner.model.vlm_loading import text_model
from tgi_paged_backend.runner.native.checks import (
    bf16_step,
    fp32_params,
    own_proven,
    prefill_output,
    reproduces,
    reproduces_bf16,
)
from tgi_paged_backend.runner.native.lora import layer_lora
from tgi_paged_backend.runner.native.stack import DecodeStack, stack_layers
from tgi_paged_backend.runner.parallel.row_parallel import local_sums
from tgi_paged_kernels import (
    LayerStack,
    LayerWeights,
    NativeKernels,
    PackedInt8,
    decode_layer,
    decode_layer_parts,
    native_kernels,
)

MAX_ROWS = 256
"""Decode batches up to this many requests run natively (scratch and tiles sized for decode)."""
MAX_QUERY_ROWS = 16
"""A step of several rows per request runs natively when each request has at most this many new rows and earlier
context (a verify step: the last token and its draft; prompts keep the prefill path)."""


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
        """The adapters' routing when the layer has LoRA wrappers."""
        found = layer_lora(layer)
        self.lora = found if not isinstance(found, str) else None
        """The adapters as the native step adds them; ``None``: steps with adapter rows run the per-op path
        (:attr:`lora_kept` says why when the layer has adapters)."""
        self.lora_kept = found if isinstance(found, str) else None
        self.verify_steps = False
        """Whether verify steps run natively (set when the load-time check has shown one gives the original's)."""
        row_parallel = row_parallel_part(layer_attention(layer).o_proj)[2]
        self._all_reduce = None if row_parallel is None else row_parallel.all_reduce
        """A tensor-parallel rank's layer (its o and down projections row-parallel): what sums their partial sums
        over the ranks, between the native calls of :func:`~tgi_paged_kernels.decode_layer_parts`; ``None``: the
        whole layer is one call."""
        self.calls = [0]
        """``[decode steps run natively]`` (:attr:`native_steps`; a list: counting needs no ``Module.__setattr__``)."""
        self.stack: DecodeStack | None = None
        """The layer list's stack (:mod:`.stack`) when every layer in it is native; :attr:`stack_index` this
        layer's place in it."""
        self.stack_index = 0
        self._replaced: list[tuple[nn.Module, str, nn.Module]] = []
        """``(owner, name, original GEMM)`` of :meth:`own_projections`, until kept or restored."""
        self.as_tuple = False
        """transformers before 4.54 returns ``(hidden,)`` from a decoder layer, later versions the tensor: set
        by the load-time check (:func:`.checks.reproduces`) from what the wrapped layer returns."""

    @property
    def native_steps(self) -> int:
        """Decode steps this layer ran natively, alone or in its stack (the load-time check needs one)."""
        return self.calls[0]

    def own_projections(self) -> None:
        """Make the packed weights the only copy: the wrapped layer's four projections become
        :class:`NativeLinear` views of them (prefills then run the native GEMM too); :meth:`restore_projections`
        puts the originals back."""
        attn, mlp, w = cast(FusedPagedAttention, layer_attention(self.layer)), layer_mlp(self.layer), self.weights
        qkv_width = (w.num_q_heads + 2 * w.num_kv_heads) * w.head_dim
        h, q_width = w.hidden_size, w.num_q_heads * w.head_dim
        o_owner, o_name, o_bias = _computing(attn, "o_proj", w.o_bias)
        native: dict[tuple[nn.Module, str], nn.Module] = {
            (attn, "qkv_proj"): self._linear(0, qkv_width, w.qkv_bias, h),
            (o_owner, o_name): self._linear(1, h, o_bias, q_width),
        }
        if w.form.experts:  # the experts' packed weights serve the other steps too (the router keeps its own)
            act_fn = cast(nn.Module, mlp.experts.act_fn)
            native[(mlp, "experts")] = NativeExperts(
                w.gate_up, w.down, w.form.experts, w.intermediate, act_fn, self.native
            )
            if w.shared_gate_up is not None and w.shared_down is not None:  # Qwen2-MoE's (fused) shared expert
                shared, width = mlp.shared_expert, w.shared_intermediate
                native[(shared, "gate_up")] = NativeLinear(w.shared_gate_up, 2 * width, None, self.native, h)
                down_owner, down_name, _ = _computing(shared, "down_proj", None)  # a rank's: its local columns
                native[(down_owner, down_name)] = NativeLinear(w.shared_down, h, None, self.native, width)
        else:
            up, down, _ = cast(tuple[str, str, str], mlp_parts(mlp))
            down_owner, down_name, down_bias = _computing(mlp, down, w.down_bias)
            native[(mlp, up)] = self._linear(2, (1 + w.form.gated) * w.intermediate, w.gate_up_bias, h)
            native[(down_owner, down_name)] = self._linear(3, h, down_bias, w.intermediate)
        for (owner, name), linear in native.items():  # under any LoRA wrappers, which stay
            original = lora_base(getattr(owner, name))
            if isinstance(linear, NativeLinear) and w.weight_dtype == torch.bfloat16:  # prefills: torch's bf16 GEMM
                linear.keep_dense(cast(nn.Linear, original))
            self._replaced.append((owner, name, original))
            setattr(owner, name, replace_lora_base(getattr(owner, name), linear))

    def restore_projections(self) -> None:
        """Undo :meth:`own_projections` (its check failed, or another rank's did): each original GEMM back, under
        any LoRA wrappers."""
        for owner, name, original in reversed(self._replaced):
            setattr(owner, name, replace_lora_base(getattr(owner, name), original))
        self._replaced.clear()

    def keep_projections(self) -> None:
        """Drop the originals kept for :meth:`restore_projections`: the packed weights are the only copy."""
        self._replaced.clear()

    def _linear(self, index: int, width: int, bias: torch.Tensor | None, in_features: int) -> nn.Module:
        """The module of projection ``index`` (qkv, o, gate_up, down) over its packed weight (fp32, bf16, int8, fp8)."""
        w = self.weights
        packed = (w.qkv, w.o, w.gate_up, w.down)[index]
        if w.int8_columns is None:
            return NativeLinear(packed, width, bias, self.native, in_features)
        zeros, scales = w.int8_columns[2 * index : 2 * index + 2]
        return NativeInt8Linear(PackedInt8(packed, zeros, scales, width, fp8=w.fp8_codes), bias, self.native)

    def __getattr__(self, name: str) -> Any:
        """Attributes of the wrapped layer read through (``self_attn``, ``mlp``, ``attention_type``, ...)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def _given_metadata(self, kwargs: dict[str, Any]) -> PagedAttentionMetadata | None:
        """The step's metadata: the model call's keyword, or (Falcon) our attention's channel."""
        metadata: PagedAttentionMetadata | None = kwargs.get(METADATA_KWARG)
        if metadata is None and self.channel is not None:
            metadata = self.channel.metadata
        return metadata

    def step_tables(
        self, position_embeddings: Any, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """``(cos, sin)`` as the native step takes them (``dtype``, the hidden state's; ``(None, None)`` for the
        rotary kind ``none``), or ``None`` when the model passed no tables (the per-op path serves)."""
        if self.rope == "none":
            return None, None
        if position_embeddings is None:
            return None
        cos, sin = rope_tables(position_embeddings, self.rope)
        if cos.dtype != dtype:  # the step takes them alike
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def _native_step(self, hidden: torch.Tensor, kwargs: dict[str, Any]) -> PagedAttentionMetadata | None:
        metadata = self._given_metadata(kwargs)
        if metadata is None or hidden.shape[0] != 1 or not self.takes_step(metadata, int(hidden.shape[1])):
            return None
        return metadata

    def takes_step(self, metadata: PagedAttentionMetadata, rows: int) -> bool:
        """Whether this layer's native call takes a step of ``rows`` packed rows (a decode step, or a verify step on a
        layer that runs them) with this metadata; else the per-op path serves it."""
        return not (
            not (metadata.batch.is_decode or (self.verify_steps and _verify_rows(metadata.batch)))
            or metadata.static
            or metadata.layer_calls is not None
            or metadata.seen_options is not None
            or metadata.k_scale != 1.0
            or metadata.v_scale != 1.0
            or rows > MAX_ROWS
            or metadata.cpu_decode != "native"  # TGI_PAGED_CPU_DECODE=compiled|sdpa: that kernel serves
            or (self.lora is None and self.lora_step is not None and self.lora_step.token_slots is not None)
            or torch.compiler.is_compiling()
        )

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        stack = self.stack
        if stack is not None and self.stack_index:
            if stack.passes_through(self.stack_index, self._given_metadata(kwargs)):  # the first layer ran them all
                return (hidden_states,) if self.as_tuple else hidden_states
            stack.observe(self.stack_index, kwargs.get("position_embeddings"))
        metadata = self._native_step(hidden_states, kwargs)
        tables = kwargs.get("position_embeddings")
        if stack is not None and not self.stack_index:
            stack.observe(0, tables)
            if metadata is not None:
                out = stack.run(hidden_states, tables, metadata)
                if out is not None:
                    return (out,) if self.as_tuple else out
        rope = None if metadata is None else self.step_tables(tables, hidden_states.dtype)
        if metadata is None or rope is None:
            return self.layer(hidden_states, *args, **kwargs)
        cos, sin = rope
        slot_mapping, block_tables = metadata.tables(self.layer_idx)
        batch = metadata.batch
        token_slots = None if self.lora_step is None else self.lora_step.token_slots
        step = (
            self.native, self.weights, hidden_states[0], cos, sin,
            metadata.k_caches[self.layer_idx], metadata.v_caches[self.layer_idx],
            slot_mapping, block_tables, batch.seq_lens, None if batch.is_decode else batch.query_start_loc,
            None if token_slots is None else self.lora, token_slots,
        )  # fmt: skip
        out = decode_layer(*step) if self._all_reduce is None else decode_layer_parts(*step[:10], self._all_reduce)
        if out is None:  # inputs of another kind (slot dtype, RoPE table layout): the per-op path serves
            return self.layer(hidden_states, *args, **kwargs)
        self.calls[0] += 1
        return (out.unsqueeze(0),) if self.as_tuple else out.unsqueeze(0)


def _verify_rows(batch: Any) -> bool:
    """Whether every request of ``batch`` has earlier context and at most :data:`MAX_QUERY_ROWS` new rows."""
    qsl, seq_lens = batch.query_start_loc, batch.seq_lens
    if qsl.device.type != "cpu":
        return False
    q_lens = (qsl[1:] - qsl[:-1]).numpy()
    return bool(q_lens.max(initial=0) <= MAX_QUERY_ROWS and (seq_lens.numpy() > q_lens).all())


def _computing(owner: nn.Module, name: str, bias: torch.Tensor | None) -> tuple[nn.Module, str, torch.Tensor | None]:
    """Where the native GEMM of ``owner.name`` goes and the bias it adds: the projection itself, or a tensor-parallel
    rank's row-parallel projection's ``local`` linear, without bias (added after the all-reduce, which stays)."""
    row_parallel = row_parallel_part(getattr(owner, name))[2]
    return (owner, name, bias) if row_parallel is None else (row_parallel, "local", None)


@dataclass(frozen=True, slots=True)
class NativeLayersReport:
    """What :func:`wrap_native_layers` wrapped (logged at start-up, asserted by the tests)."""

    wrapped: int
    kept: tuple[str, ...]
    """Why candidates kept their Python path (one line per distinct reason)."""
    stacks: tuple[DecodeStack, ...] = ()
    """The layer lists whose layers are all native (:mod:`.stack`: one call per decode step once proven)."""
    stack_kept: tuple[str, ...] = ()
    """Why a layer list of native layers has no stack."""


def _candidate(
    child: nn.Module, native: NativeKernels, block_size: int, kv_dtype: torch.dtype
) -> NativeDecoderLayer | str:
    """``child`` wrapped, its step proven (fp32: :func:`.checks.reproduces`; bf16: the description on the layer
    widened to fp32, then :func:`.checks.reproduces_bf16`; a tensor-parallel rank's with the all-reduces as the
    identity), its verify and LoRA steps checked the same way (whole layers only), or why it keeps its Python
    path."""
    bf16 = compute_dtype(child) == torch.bfloat16
    with fp32_params(child) if bf16 else nullcontext():
        weights = layer_weights(child)
        if isinstance(weights, str):
            return weights
        candidate = NativeDecoderLayer(child, weights, native)
        with local_sums(candidate):
            if not _proven(reproduces, child, candidate, block_size):
                return "its decode step differs"
            _prove_features(candidate, lambda rows, lora: _proven(reproduces, child, candidate, block_size, rows, lora))
            if not bf16:
                return own_proven(child, candidate, block_size, kv_dtype)
            try:
                exact_prefill = prefill_output(child, candidate, block_size, True)
            except Exception as e:  # noqa: BLE001 - any failure means: keep the Python path
                return f"its fp32 prefill failed ({type(e).__name__})"
            steps = [(1, False)]
            steps += [(VERIFY_CHECK_ROWS, False)] if candidate.verify_steps else []
            steps += [(1, True)] if candidate.lora is not None else []
            exact = {s: bf16_step(child, candidate, block_size, torch.float32, torch.float32, *s) for s in steps}
    try:
        bf16_candidate = NativeDecoderLayer(child, weights.as_bf16(), native)
    except ValueError as e:
        return str(e)
    bf16_candidate.as_tuple = candidate.as_tuple

    def bf16_proof(rows: int, lora: bool) -> bool:
        return _proven(reproduces_bf16, child, bf16_candidate, block_size, kv_dtype, exact[rows, lora], rows, lora)

    with local_sums(bf16_candidate):
        if not bf16_proof(1, False):
            return "its bf16 decode step differs"
        if candidate.lora is None:  # the fp32 description's LoRA step failed (or a rank's): so does the bf16 one
            bf16_candidate.lora, bf16_candidate.lora_kept = None, candidate.lora_kept
        _prove_features(bf16_candidate, bf16_proof, candidate.verify_steps)
    return own_proven(child, bf16_candidate, block_size, kv_dtype, exact_prefill)


VERIFY_CHECK_ROWS = 3
"""Rows per request of the verify check step."""


def _prove_features(candidate: NativeDecoderLayer, proof: Callable[[int, bool], bool], verify: bool = True) -> None:
    """Check ``candidate``'s verify steps (``verify``: not already known to differ) and its LoRA steps (when it adds
    adapters) with ``proof(rows, lora)``; each that fails keeps the per-op path. A tensor-parallel rank's run per
    op: its parts take one row per request and no adapters."""
    if candidate._all_reduce is not None:
        candidate.lora = None
        return
    candidate.verify_steps = verify  # a verify step runs natively only while its check does, then if it passed
    candidate.verify_steps = verify and proof(VERIFY_CHECK_ROWS, False)
    if candidate.lora is not None and not proof(1, True):
        candidate.lora, candidate.lora_kept = None, "its LoRA step differs"


def _proven(check: Any, layer: nn.Module, *args: Any) -> bool:
    """``check(layer, *args)``, any failure counting as not proven (logged at debug level)."""
    try:
        return bool(check(layer, *args))
    except Exception as e:  # noqa: BLE001 - any failure means: keep the Python path
        logger.debug("layer {} not native: {}: {}", type(layer).__name__, type(e).__name__, e)
        return False


Agree = Callable[[list[bool]], list[bool]]
"""Tensor parallelism: each layer's check outcome on this rank to the outcomes every rank agrees on (a layer is
wrapped only where every rank's check passed: a rank running the native parts and another the per-op layer
would make different all-reduces)."""


def wrap_native_layers(
    model: nn.Module, block_size: int, kv_dtype: torch.dtype = torch.float32, agree: Agree | None = None
) -> NativeLayersReport:
    """Wrap the decoder layers of ``model`` whose form is described and reproduced (see the module docstring) in
    place, their checks over pools of ``kv_dtype``; other decoder layers are reported as kept, with the reason. A
    tensor-parallel rank checks its own slices with the all-reduces as the identity (no collective:
    :func:`~..parallel.row_parallel.local_sums`), then wraps what ``agree`` returns (every candidate layer's
    outcome, in model order, on every rank)."""
    native = native_kernels()
    kept = set()
    candidates: list[tuple[nn.Module, str, NativeDecoderLayer | None]] = []
    for parent in list(text_model(model).modules()):  # a VLM's vision tower has no decode step
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            layer_like = kind.endswith(("DecoderLayer", "Block")) and (hasattr(child, "mlp") or hasattr(child, "ffn"))
            if isinstance(child, NativeDecoderLayer) or (kind not in NORM_PLACES and not layer_like):
                continue
            candidate = _candidate(child, native, block_size, kv_dtype) if native is not None else "no native kernels"
            if isinstance(candidate, str):
                kept.add(f"{kind}: {candidate}")
                candidates.append((parent, name, None))
                continue
            if candidate.lora_kept:
                kept.add(f"{kind}: LoRA steps per op: {candidate.lora_kept}")
            if not candidate.verify_steps and candidate._all_reduce is None:
                kept.add(f"{kind}: verify steps per op: its verify step differs")
            candidates.append((parent, name, candidate))
    if agree is not None and candidates:
        for i, agreed in enumerate(agree([c is not None for _, _, c in candidates])):
            parent, name, passed = candidates[i]
            if passed is not None and not agreed:
                kept.add(f"{type(passed.layer).__name__}: another rank's check failed")
                passed.restore_projections()
                candidates[i] = (parent, name, None)
    wrapped = 0
    for parent, name, passed in candidates:
        if passed is not None:
            passed.keep_projections()  # every rank agreed: the originals go
            setattr(parent, name, passed)
            wrapped += 1
    stacks, stack_kept = _stacks({parent for parent, _, passed in candidates if passed is not None}, native)
    report = NativeLayersReport(
        wrapped=wrapped, kept=tuple(sorted(kept)), stacks=tuple(stacks), stack_kept=tuple(sorted(stack_kept))
    )
    if wrapped or kept:
        logger.info("native decode layers: {} wrapped{}", wrapped, f"; kept: {'; '.join(report.kept)}" if kept else "")
    return report


def _stacks(parents: set[nn.Module], native: NativeKernels | None) -> tuple[list[DecodeStack], set[str]]:
    """A :class:`~.stack.DecodeStack` for each layer list (a parent of wrapped layers) whose children are all
    native layers, and why the others have none."""
    stacks, kept = [], set()
    for parent in parents:
        layers = list(parent.children())
        if native is None or not all(isinstance(layer, NativeDecoderLayer) for layer in layers):
            kept.add("some layers of the list run per op")
            continue
        found = stack_layers(cast(list[NativeDecoderLayer], layers), lambda weights: LayerStack(native, weights))
        if isinstance(found, str):
            kept.add(found)
        else:
            stacks.append(found)
    return stacks, kept
