"""A decoder layer's decode step as one native call (``csrc/cpu_layer.cpp``), for every layer form a
:class:`LayerForm` describes, with its torch references.

On a small model a decode step is host time: per layer transformers' modules and our fused blocks still
make ~10 calls (two to four norms, four GEMMs, RoPE, the KV store, the attention, the activation, two
residual adds), each with its Python, dispatch and OpenMP fork. :func:`decode_layer` runs all of it in one
call and one OpenMP region, on weights packed once (:func:`pack_weight`) for a GEMM whose every output is
one sequential sum (:mod:`.cpu_gemm`: the same whatever the rows or threads). The arithmetic is fp32; the
projections are packed in fp32, bf16 (:meth:`LayerWeights.as_bf16`) or int8 (:mod:`.cpu_quant`), the hidden state
(with the RoPE tables) and the pools are fp32 or bf16 (a bf16 hidden state is widened at entry and rounded at exit,
a bf16 pool stores rounded K/V and is read widened); the caller (``runner.native.layers``) decides when it
applies.

The layer is data, not code: :class:`LayerForm` says which norms the layer has and where (before and
after attention and MLP: Llama's two pre-norms, Gemma 2/3's sandwich, OLMo2's post-norms), their kind
(``w`` or Gemma's ``1 + w``), q/k norms per head or over all heads, the gated MLP's activation, the q/k/v
bias, the attention's scale, soft-cap and window, a residual scale (Granite), the rotary kind (neox, Cohere's
interleaved pairs, none: learned positions), LayerNorms with or without bias, norms after the residual add
(OPT's post-LN), the activation (SiLU, GeLU, GeLU-tanh, ReLU) and a parallel attention + MLP block (Cohere,
Falcon). The Llama form is ``LayerForm(scale=head_dim ** -0.5)``.

References (the specification; ``tests/kernels/test_cpu_layer.py`` compares them with the kernels):
:func:`.cpu_layer_ref.gemm_packed_ref`, :func:`.cpu_layer_ref.decode_layer_ref`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from .cpu_gemm import PACK_BLOCK, bf16_from_packed, gemm_packed, pack_weight, packed_shape
from .cpu_layer_step import LayerStep, address
from .cpu_native import NativeKernels

if TYPE_CHECKING:
    from .cpu_layer_lora import LayerLora

__all__ = ["PACK_BLOCK", "LayerForm", "LayerWeights", "decode_layer", "gemm_packed", "pack_weight"]

NORM_KINDS = ("rms", "rms_1p", "layer")
"""Norm kinds: ``rms`` is ``w * x / rms(x)`` (Llama), ``rms_1p`` is ``(1 + w) * x / rms(x)`` (Gemma), ``layer``
a LayerNorm, ``w * (x - mean) / std (+ b)`` (Cohere without bias, Phi with; layer norms only, not q/k norms)."""
ROPE_KINDS = ("neox", "interleaved", "none")
"""Rotary kinds: neox (halves rotate, Llama), interleaved (pairs ``2i, 2i + 1``, Cohere), none (Cohere2's full
layers)."""
QK_NORMS = ("none", "head", "all")
"""q/k norms: none, per head over ``head_dim`` (Qwen3, Gemma 3), over all query / all key heads (OLMo2)."""
ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu")
"""The MLP's activation: SiLU (Llama), GeLU with the tanh approximation (Gemma, Phi, GPT-2, GPT-BigCode) or exact
(GPT-NeoX, Falcon), ReLU (OPT)."""


@dataclass(frozen=True, slots=True)
class LayerForm:
    """What one decoder layer computes, as data: the native step runs any form, the reference specifies it.

    ``h += residual_scale * attn_out(attention(h'))`` with ``h' = attn_in(h)``, then
    ``h += residual_scale * mlp_out(down(act(gate) * up)(mlp_in(h)))``, where each of the four norms is an
    RMSNorm of kind :attr:`norm` or absent (identity).
    """

    scale: float
    """Attention softmax scale (``head_dim ** -0.5``; Gemma's ``query_pre_attn_scalar ** -0.5``; Granite's
    attention multiplier)."""
    norm: str = "rms"
    """Kind of the layer's four norms (:data:`NORM_KINDS`)."""
    eps: float = 1e-6
    attn_in_norm: bool = True
    """A norm before attention (``input_layernorm``)."""
    attn_out_norm: bool = False
    """A norm of the attention's output before the residual add (Gemma 2/3 sandwich, OLMo2)."""
    mlp_in_norm: bool = True
    """A norm before the MLP (Llama's ``post_attention_layernorm``, Gemma's ``pre_feedforward_layernorm``)."""
    mlp_out_norm: bool = False
    """A norm of the MLP's output before the residual add (Gemma 2/3, OLMo2)."""
    qk_norm: str = "none"
    """q/k RMSNorms after the q/k/v projection, before RoPE (:data:`QK_NORMS`)."""
    qk_norm_kind: str = "rms"
    qk_eps: float = 1e-6
    activation: str = "silu"
    qkv_bias: bool = False
    softcap: float = 0.0
    """Attention logit soft-cap (Gemma 2), 0 for none."""
    window: int = 0
    """Sliding window in positions, 0 for full attention."""
    residual_scale: float = 1.0
    """Each block's output is multiplied by this before the residual add (Granite's ``residual_multiplier``)."""
    rope: str = "neox"
    """Rotary kind (:data:`ROPE_KINDS`)."""
    parallel: bool = False
    """Attention and MLP both read ``h``: ``h += attn(attn_in(h)) + mlp(mlp_in(h))``, ``mlp_in`` the same norm as
    ``attn_in`` when absent (Cohere, Phi; GPT-NeoX has both). Needs ``attn_in``, no post-norm, residual scale 1."""
    rotary_dim: int = 0
    """RoPE on the first ``rotary_dim`` values of each head, the rest kept (Phi's partial rotary); 0: all."""
    gated: bool = True
    """``down(act(gate) * up)``; False: ``down(act(up))`` with one up projection (Phi's fc1/fc2; GeLU only)."""
    norm_bias: bool = False
    """The layer norms (``layer`` kind) add a bias (Phi's ``nn.LayerNorm``)."""
    o_bias: bool = False
    """The o projection adds a bias (Phi)."""
    mlp_bias: bool = False
    """The gate/up and down projections add a bias (Phi, GPT-NeoX)."""
    experts: int = 0
    """An MoE MLP of this many experts (Mixtral, Qwen3-MoE): each token's ``top_k`` experts of the router's softmax
    (renormalized over them when :attr:`norm_top_k`), each a gated MLP of its own, summed with those weights; 0: one
    MLP."""
    top_k: int = 0
    norm_top_k: bool = False
    shared_expert: bool = False
    """MoE: plus an always-on gated MLP of its own, scaled by ``sigmoid(x . w)`` of a one-row gate (Qwen2-MoE)."""
    post_add_norms: bool = False
    """The ``attn_out`` / ``mlp_out`` norms apply to ``h`` after the residual add, ``h = n(h + block(...))``, not to
    the block's output before it (OPT with ``do_layer_norm_before=False``: post-LN)."""

    def __post_init__(self) -> None:
        if self.norm not in NORM_KINDS or self.qk_norm_kind not in NORM_KINDS:
            raise ValueError(f"LayerForm: norm kinds are {NORM_KINDS}, got {self.norm!r} / {self.qk_norm_kind!r}")
        if self.qk_norm not in QK_NORMS or self.activation not in ACTIVATIONS:
            raise ValueError(f"LayerForm: q/k norm {self.qk_norm!r} or activation {self.activation!r} unknown")
        if self.qk_norm_kind == "layer" or self.rope not in ROPE_KINDS:
            raise ValueError(f"LayerForm: q/k norm kind {self.qk_norm_kind!r} or rotary {self.rope!r} not run")
        others = self.attn_out_norm or self.mlp_out_norm or self.residual_scale != 1
        if self.parallel and (not self.attn_in_norm or others):
            raise ValueError("LayerForm: a parallel block has one norm before both blocks and residual scale 1")
        if (not self.gated and self.activation == "silu") or (self.norm_bias and self.norm != "layer"):
            raise ValueError("LayerForm: an ungated MLP is GeLU or ReLU; only LayerNorms have a bias")
        if self.experts and (not self.gated or self.mlp_bias or not 0 < self.top_k <= self.experts):
            raise ValueError(f"LayerForm: {self.experts} experts are gated MLPs without bias, top_k {self.top_k}")
        if self.shared_expert and not self.experts:
            raise ValueError("LayerForm: a shared expert is part of an MoE MLP")
        if self.post_add_norms and (self.parallel or self.residual_scale != 1):
            raise ValueError("LayerForm: norms after the residual add are for sequential blocks of residual scale 1")
        if self.window < 0 or self.softcap < 0 or self.rotary_dim < 0 or self.rotary_dim % 2:
            raise ValueError(f"LayerForm: window {self.window}, softcap {self.softcap} >= 0, rotary_dim even")

    @property
    def norms(self) -> tuple[str, ...]:
        """Names of the layer norms this form has, of :data:`LAYER_NORMS`."""
        flags = (self.attn_in_norm, self.attn_out_norm, self.mlp_in_norm, self.mlp_out_norm)
        return tuple(name for name, on in zip(LAYER_NORMS, flags) if on)


LAYER_NORMS = ("attn_in", "attn_out", "mlp_in", "mlp_out")
"""Where a layer norm can sit (:class:`LayerForm`'s flags, :class:`LayerWeights`' fields)."""
BIASES = tuple(f"{name}_bias" for name in LAYER_NORMS)
"""The layer norms' biases (:attr:`LayerForm.norm_bias`)."""


def norm_weight(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """The weight an RMSNorm of ``kind`` multiplies by, fp32 contiguous: ``w``, or ``1 + w`` (rounded as
    transformers' Gemma norms round it)."""
    w = weight.detach().float()
    return (1.0 + w if kind == "rms_1p" else w).contiguous()


class _Spec(ctypes.Structure):
    """``LayerSpec`` of ``csrc/cpu_layer.cpp``, field for field."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("hidden_size", "intermediate")),
        *((name, ctypes.c_int32) for name in "hq hkv head_dim window activation qk_norm rope parallel".split()),
        *((name, ctypes.c_int32) for name in ("layer_norm", "rotary_dim", "gated", "post_add_norms")),
        *((name, ctypes.c_int32) for name in ("experts", "top_k", "norm_top_k", "shared_intermediate")),
        *((name, ctypes.c_float) for name in ("scale", "softcap", "residual_scale")),
        ("weight_dtype", ctypes.c_int32),  # 0 fp32, 1 bf16, 2 int8 codes, 3 fp8 e4m3 codes
        *((f"eps_{name}", ctypes.c_float) for name in (*LAYER_NORMS, "q", "k")),
        *((name, ctypes.c_void_p) for name in (*LAYER_NORMS, "q_norm", "k_norm", "qkv", "qkv_bias", "o", "gu", "down")),
        *((name, ctypes.c_void_p) for name in (*BIASES, "o_bias", "gate_up_bias", "down_bias", "router")),
        *((name, ctypes.c_void_p) for name in ("shared_gate_up", "shared_down", "shared_gate")),
        ("w_zeros", ctypes.c_void_p * 4),
        ("w_scales", ctypes.c_void_p * 4),
    ]


_PROJECTIONS = ("qkv", "o", "gate_up", "down")
"""The four projections, in ``LayerSpec``'s order (``kQkv`` .. ``kDown``)."""
_SHARED = ("shared_gate_up", "shared_down", "shared_gate")
"""A shared expert's weights (:attr:`LayerForm.shared_expert`)."""


def _pack_each(weight: torch.Tensor) -> torch.Tensor:
    """:func:`pack_weight` of a ``[N, K]`` weight, or of each expert's ``[N, K]`` of ``[E, N, K]``, in turn."""
    if weight.dim() == 3:
        return torch.cat([pack_weight(w) for w in weight.detach()])
    return pack_weight(weight)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer of ``form``, packed for :func:`decode_layer` (fp32 CPU tensors).

    Norm weights are the ones the norm multiplies by (:func:`norm_weight`: ``1 + w`` folded in for Gemma's
    kind); a norm the form lacks is ``None``. Build with :meth:`pack` from the module's weights."""

    form: LayerForm
    hidden_size: int
    intermediate: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    qkv: torch.Tensor
    """Packed ``[(Hq + 2 Hkv) D, H]``: query, key and value heads in order."""
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    """Packed ``[2 I, H]``, gate rows first (``[I, H]`` for an ungated MLP)."""
    down: torch.Tensor
    attn_in: torch.Tensor | None = None
    attn_out: torch.Tensor | None = None
    mlp_in: torch.Tensor | None = None
    mlp_out: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_in_bias: torch.Tensor | None = None
    attn_out_bias: torch.Tensor | None = None
    mlp_in_bias: torch.Tensor | None = None
    mlp_out_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    router: torch.Tensor | None = None
    shared_gate_up: torch.Tensor | None = None
    """The shared expert's packed ``[2 Is, H]`` (Qwen2-MoE), its ``[H, Is]`` down and ``[1, H]`` gate next."""
    shared_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    """MoE: the router's packed ``[E, H]``; then :attr:`gate_up` and :attr:`down` hold every expert's packed
    weight in turn."""
    weight_dtype: torch.dtype = torch.float32
    """How the projections are packed: fp32 (:func:`.cpu_gemm.pack_weight`) or bf16 (:meth:`as_bf16`); norm
    weights and biases stay fp32."""
    int8_columns: tuple[torch.Tensor, ...] | None = None
    """``None``: projections packed in :attr:`weight_dtype`. Else :attr:`qkv`, :attr:`o`, :attr:`gate_up`,
    :attr:`down` hold int8 codes packed by :func:`.cpu_quant.pack_int8` (:attr:`weight_dtype` fp32) and this their
    columns' zero points and scales, ``(qkv zeros, qkv scales, o zeros, ...)`` (:func:`.cpu_quant.pack_int8_layer`
    builds it)."""
    fp8_codes: bool = False
    """With :attr:`int8_columns`: the codes are fp8 e4m3 bytes (:func:`.cpu_quant.pack_fp8`; zeros unused)."""
    spec: Any = field(default=None, init=False, repr=False, compare=False)
    """The ``LayerSpec`` the native call reads (addresses of the tensors above, which this object keeps)."""

    def _weight_code(self) -> int:
        """``LayerSpec.weight_dtype``: 0 fp32, 1 bf16, 2 int8 codes, 3 fp8 e4m3 codes."""
        if self.int8_columns is not None:
            return 3 if self.fp8_codes else 2
        return int(self.weight_dtype == torch.bfloat16)

    @classmethod
    def pack(
        cls, form: LayerForm, raw: dict[str, torch.Tensor | None], *, num_q_heads: int, num_kv_heads: int, head_dim: int
    ) -> LayerWeights:
        """From the module's weights: ``qkv``, ``qkv_bias``, ``o``, ``gate_up``, ``down`` (``[N, K]``) and the
        norms' own weights (``attn_in`` ..., ``q_norm``, ``k_norm``, as the modules hold them)."""

        def need(name: str) -> torch.Tensor:
            t = raw.get(name)
            if t is None:
                raise ValueError(f"LayerWeights.pack: the form needs {name!r}")
            return t

        hidden, intermediate = int(need("o").shape[0]), int(need("down").shape[-1])
        norms: dict[str, Any] = {name: norm_weight(need(name), form.norm) for name in form.norms}
        if form.qk_norm != "none":
            norms.update({n: norm_weight(need(n), form.qk_norm_kind) for n in ("q_norm", "k_norm")})
        bias = need("qkv_bias").detach().float().contiguous() if form.qkv_bias else None
        biases = [f"{name}_bias" for name in form.norms] if form.norm_bias else []
        biases += (["o_bias"] if form.o_bias else []) + (["gate_up_bias", "down_bias"] if form.mlp_bias else [])
        norms.update({name: need(name).detach().float().contiguous() for name in biases})
        norms.update({name: pack_weight(need(name)) for name in (_SHARED if form.shared_expert else ())})
        return cls(
            form, hidden, intermediate, num_q_heads, num_kv_heads, head_dim,
            qkv=pack_weight(need("qkv")), qkv_bias=bias, o=pack_weight(need("o")),
            gate_up=_pack_each(need("gate_up")), down=_pack_each(need("down")),
            router=pack_weight(need("router")) if form.experts else None,
            **norms,
        )  # fmt: skip

    def __post_init__(self) -> None:
        f, h, d = self.form, self.hidden_size, self.head_dim
        widths = {"head": (d, d), "all": (self.num_q_heads * d, self.num_kv_heads * d)}.get(f.qk_norm)
        expected = {
            **{name: h if name in f.norms else None for name in LAYER_NORMS},
            "q_norm": widths and widths[0],
            "k_norm": widths and widths[1],
            "qkv_bias": (self.num_q_heads + 2 * self.num_kv_heads) * d if f.qkv_bias else None,
            **{f"{name}_bias": h if f.norm_bias and name in f.norms else None for name in LAYER_NORMS},
            "o_bias": h if f.o_bias else None,
            "down_bias": h if f.mlp_bias else None,
            "gate_up_bias": (2 if f.gated else 1) * self.intermediate if f.mlp_bias else None,
        }
        for name, width in expected.items():
            t = getattr(self, name)
            if (t is None) != (width is None) or (
                t is not None and (t.dtype != torch.float32 or t.shape != (width,) or not t.is_contiguous())
            ):
                raise ValueError(f"LayerWeights: {name} does not fit the form (want an fp32 [{width}] or None)")
        experts, n_gu, dtype = max(1, f.experts), (2 if f.gated else 1) * self.intermediate, self.weight_dtype
        int8, columns = self.int8_columns is not None, self.int8_columns or ()
        hq_d, n_qkv, si = self.num_q_heads * d, (self.num_q_heads + 2 * self.num_kv_heads) * d, self.shared_intermediate
        packed = {
            "qkv": packed_shape(n_qkv, h, dtype),
            "o": packed_shape(h, hq_d, dtype),
            "gate_up": packed_shape(n_gu, h, dtype, experts),
            "down": packed_shape(h, self.intermediate, dtype, experts),
            "router": packed_shape(f.experts, h, dtype) if f.experts else None,
            "shared_gate_up": packed_shape(2 * si, h, dtype) if f.shared_expert else None,
            "shared_down": packed_shape(h, si, dtype) if f.shared_expert else None,
            "shared_gate": packed_shape(1, h, dtype) if f.shared_expert else None,
        }
        for name, shape in packed.items():
            t = getattr(self, name)
            want = torch.uint8 if int8 and name in _PROJECTIONS else dtype
            if (t is None) != (shape is None) or (
                t is not None and (t.shape != shape or t.dtype != want or not t.is_contiguous())
            ):
                raise ValueError(f"LayerWeights: {name} is not a packed {shape} {want} for this form (or None)")
        if int8 and (f.experts or len(columns) != 8 or dtype != torch.float32):
            raise ValueError("LayerWeights: int8 codes are the four projections' (no MoE), with their 8 column tensors")
        if self.num_q_heads % self.num_kv_heads or d % 2 or f.rotary_dim > d:
            raise ValueError(f"LayerWeights: {self.num_q_heads} query heads over {self.num_kv_heads}, head_dim {d}")
        spec = _Spec(
            h, self.intermediate, self.num_q_heads, self.num_kv_heads, d, f.window,
            ACTIVATIONS.index(f.activation), QK_NORMS.index(f.qk_norm), ROPE_KINDS.index(f.rope), int(f.parallel),
            int(f.norm == "layer"), f.rotary_dim or d, int(f.gated), int(f.post_add_norms),
            f.experts, f.top_k, int(f.norm_top_k), self.shared_intermediate,
            f.scale, f.softcap, f.residual_scale, self._weight_code(),
            *(f.eps for _ in LAYER_NORMS), f.qk_eps, f.qk_eps,
            *(address(getattr(self, name)) for name in (*LAYER_NORMS, "q_norm", "k_norm", "qkv", "qkv_bias")),
            self.o.data_ptr(), self.gate_up.data_ptr(), self.down.data_ptr(),
            *(address(getattr(self, name)) for name in (*BIASES, "o_bias", "gate_up_bias", "down_bias", "router")),
            *(address(getattr(self, name)) for name in _SHARED),
            *((ctypes.c_void_p * 4)(*(t.data_ptr() for t in columns[i::2])) for i in (0, 1) if int8),
        )  # fmt: skip
        object.__setattr__(self, "spec", spec)

    @property
    def shared_intermediate(self) -> int:
        """The shared expert's intermediate width (0: none; its packed down is ``[H, Is]``)."""
        if self.shared_down is None:
            return 0
        return int(self.shared_down.shape[1]) * (2 if self.weight_dtype == torch.bfloat16 else 1)

    def as_bf16(self) -> LayerWeights:
        """These weights for a bf16 model's steps: the projections packed in bf16 (:func:`.cpu_gemm.bf16_from_packed`:
        exact for a bf16 model's weights; needs even input widths, pairs of ``k``), int8 or fp8 codes as they are
        (their tile dequantizes into fp32 whatever the hidden state's dtype); norms and biases as they are."""
        if self.int8_columns is not None:
            return self
        widths = (self.hidden_size, self.intermediate, self.shared_intermediate)
        if self.weight_dtype != torch.float32 or any(k % 2 for k in widths):
            raise ValueError("LayerWeights.as_bf16: needs fp32-packed weights of even input widths")
        names = ("qkv", "o", "gate_up", "down", "router", *_SHARED)
        packed = {name: getattr(self, name) for name in names}
        repacked: dict[str, Any] = {name: None if t is None else bf16_from_packed(t) for name, t in packed.items()}
        return replace(self, **repacked, weight_dtype=torch.bfloat16)

    def scratch_floats(self, tokens: int) -> int:
        """fp32 scratch of a step of ``tokens`` rows (a bf16 hidden state's widened copy and tables included)."""
        hq, hkv, d, h = self.num_q_heads, self.num_kv_heads, self.head_dim, self.hidden_size
        moe = self.form.experts + 4 * h + (3 * self.shared_intermediate + h + 1 if self.form.shared_expert else 0)
        moe = moe if self.form.experts else 0
        widened = h + 2 * (self.form.rotary_dim or d)
        return tokens * (2 * h + (2 * hq + 3 * hkv) * d + hq * d + 3 * self.intermediate + moe + widened)


def decode_layer(
    native: NativeKernels,
    w: LayerWeights,
    hidden: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    lora: LayerLora | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The layer's output for fp32 or bf16 ``hidden`` ``[T, H]`` (one token of each of ``T`` requests; a new tensor
    of its dtype), writing the tokens' K/V into fp32 or bf16 pools ``[num_blocks, block_size, Hkv, D]`` at
    ``slot_mapping`` (int64; negative slots skipped). With ``query_start_loc`` (int32 ``[B + 1]``): ``B`` requests
    of several rows each (a speculative verify step), each row attending over its request's positions up to its
    own. With ``lora`` (:class:`.cpu_layer_lora.LayerLora`): row ``t`` adds adapter ``token_slots[t]``'s deltas
    (``-1``: none), in fp32 (a bf16 ``hidden`` too).

    ``cos``/``sin`` ``[T, rotary_dim or D]`` contiguous, of ``hidden``'s dtype (unread, may be ``None``, for the
    rotary kind ``none``); ``block_tables`` ``[T, *]`` and ``seq_lens`` ``[T]``, int32 or int64. ``None`` for inputs of
    another kind (the caller runs the per-op path); ``ValueError`` for a slot or block id outside the pool or a
    table too narrow (as the single kernels do). A tensor-parallel rank's layer:
    :func:`.cpu_layer_step.decode_layer_parts`.
    """
    step = LayerStep.prepare(
        native, w, hidden, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, lora,
        token_slots,
    )  # fmt: skip
    if step is None:
        return None
    step.run()
    return step.out
