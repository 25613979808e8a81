"""Load-time fusion of transformers' Llama-form attention and gated MLP blocks (CPU).

transformers' decoder layers stay the model definition; inside them, :func:`fuse_blocks` replaces

- a **gated MLP** (``down(act(gate(x)) * up(x))`` with plain ``nn.Linear`` projections, any activation)
  by :class:`FusedGatedMLP`: gate and up become one GEMM of both weights stacked, so a step makes one
  call where it made two (Phi-3's ``gate_up_proj`` already is one: it is taken as it is). Swapped only
  after it reproduces the original on a random input.
- a **Llama-form attention** (:data:`LLAMA_FORM_ATTENTION`: q/k/v in any checkpoint layout
  :mod:`.qkv_layouts` reads (separate linears, Phi-3's ``qkv_proj``, GPT-2's and GPT-BigCode's ``c_attn``,
  GPT-NeoX's and Falcon's ``query_key_value``), optional q/k RMSNorms per head or over all heads, RoPE from the
  model's ``position_embeddings`` or none (learned positions), optional logit soft-cap) by
  :class:`FusedPagedAttention`: q, k and v become one GEMM, RoPE runs once over the query and key heads
  together (the same arithmetic as transformers', 7 tensor ops instead of 16), and the step's paged attention
  is called directly on ``[T, heads, head_dim]`` views (no transposes, no attention interface dispatch).
  Swapped only after it reproduces the original, through the same paged attention, on a random prompt over a
  scratch pool.

Both cut the per-layer host time of a decode step (each tensor op costs ~2-30 us of dispatch before
any math; ``docs/performance-cpu.md``, "CPU forward"). They run before the linears are packed
(:mod:`tgi_paged_backend.runner.cpu.fast_layers`), so the fused projections are packed too. Quantized
projections are not plain ``nn.Linear`` and keep their blocks; a tensor-parallel rank's blocks fuse over its
slices (its row-parallel o and down projections kept as they are; the checks run with the all-reduces as the
identity: :func:`~tgi_paged_backend.runner.parallel.row_parallel.local_sums`). CPU only: on CUDA the eager
modules are captured in CUDA graphs instead (not measured with fusion; no GPU was lent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from loguru import logger
from torch import nn

from tgi_paged_backend.lora.layers import lora_base
from tgi_paged_backend.runner.attention import METADATA_KWARG, PagedAttentionMetadata, paged_attention, step_metadata
from tgi_paged_backend.runner.cpu.fast_layers import is_silu, outputs_close, same_output
from tgi_paged_backend.runner.cpu.qkv_layouts import (
    QkvLayout,
    compute_dtype,
    head_dim_of,
    linear_input,
    linearize_conv1d,
    output_projection,
    qkv_layout,
    stackable,
    stacked,
)
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.parallel.row_parallel import RowParallelLinear
from tgi_paged_backend.runner.quant.linear import Fp8Linear, IntLinear
from tgi_paged_kernels import native_kernels

CHECK_TOKENS = 12
"""Prompt length of the attention check (> the tests' windows of 8: a window must show)."""

LLAMA_FORM_ATTENTION = frozenset(
    {
        "CohereAttention",
        "Cohere2Attention",
        "LlamaAttention",
        "GemmaAttention",
        "Gemma2Attention",
        "Gemma3Attention",
        "GPT2Attention",
        "GPTBigCodeAttention",
        "GPTJAttention",
        "GPTNeoXAttention",
        "GraniteAttention",
        "MistralAttention",
        "MixtralAttention",
        "Olmo2Attention",
        "OPTAttention",
        "PagedFalconAttention",
        "Phi3Attention",
        "PhiAttention",
        "Qwen2Attention",
        "Qwen2MoeAttention",
        "Qwen2VLAttention",  # transformers >= 5 merges M-RoPE's sections in the rotary module: plain tables here
        "Qwen2_5_VLAttention",
        "Qwen3Attention",
        "Qwen3MoeAttention",
        "Starcoder2Attention",
    }
)
"""Attention classes whose forward is Llama's (q/k/v/o, or Phi-3's q/k/v in one projection; optional q/k
norm per head or over all heads, neox RoPE on ``position_embeddings``). The scale, sliding window and soft-cap
are not read from the module: the load-time check records what its forward passes to the attention function
and the fused module uses exactly that. Neither is the rotary kind: :data:`ROPE_TRIES` lists the kinds the
check tries, in order."""

ROPE_TRIES: dict[str, tuple[str, ...]] = {
    "CohereAttention": ("interleaved",),
    "Cohere2Attention": ("interleaved", "none"),
    "GPTJAttention": ("gptj",),
    **dict.fromkeys(("GPT2Attention", "GPTBigCodeAttention", "OPTAttention"), ("none",)),  # learned positions
}
"""Classes whose rotary is not neox: the kinds to try (Cohere's interleaved pairs; Cohere2's full layers have none;
GPT-J's interleaved pairs from a ``(sin, cos)`` table of half width, :func:`rope_tables`)."""


QUERY_SCALED = frozenset({"OPTAttention"})
"""Classes that multiply the query by their ``scaling`` before the attention call (which then gets 1.0): the
fused attention folds that factor into its softmax scale."""


def rope_tables(position_embeddings: Any, rope: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` ``[T, rotary_dim]`` of a step's ``position_embeddings`` (``(cos, sin)`` ``[1, T, R]``;
    GPT-J's: ``(sin, cos)`` ``[1, T, R / 2]``, each angle once for its pair)."""
    if rope == "gptj":
        sin, cos = position_embeddings
        return cos[0].repeat_interleave(2, dim=-1), sin[0].repeat_interleave(2, dim=-1)
    return position_embeddings[0][0], position_embeddings[1][0]


def rope_table_width(rope: str, rotary_dim: int) -> int:
    """The width of the ``position_embeddings`` tables the model passes for ``rope`` (:func:`rope_tables`)."""
    return rotary_dim // 2 if rope == "gptj" else rotary_dim


def _plain(*modules: Any) -> bool:
    """Plain ``nn.Linear`` GEMMs, LoRA wrappers seen through (:func:`..lora.layers.lora_base`)."""
    return all(type(lora_base(m)) is nn.Linear for m in modules)


def _fusable(*parts: Any, down: Any) -> bool:
    """Plain gate/up (one, or two stacked into one GEMM) and down projections, or int8 ones of one group per
    channel, or fp8 ones (:func:`~.qkv_layouts.stacked` stacks their codes; other int layouts keep their MLP)."""
    if all(isinstance(lora_base(m), (IntLinear, Fp8Linear)) for m in (*parts, down)):
        return stackable(*parts) and stackable(down)
    return _plain(*parts) and _plain_down(down)


def _plain_down(module: Any) -> bool:
    """A plain down projection, or a tensor-parallel rank's row-parallel one over a plain ``nn.Linear`` of its
    input columns (the MLP's output is then the all-reduced sum: fusing gate and up does not touch it)."""
    base = lora_base(module)
    return _plain(base) or (isinstance(base, RowParallelLinear) and _plain(base.local))


class FusedGatedMLP(nn.Module):
    """``down(act(x @ [gate; up]^T)[:, :I] * ...[:, I:])``: gate and up in one GEMM."""

    down_proj: nn.Module
    act_fn: nn.Module

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate and up already one projection in the checkpoint
            self.gate_up = cast(nn.Module, mlp.gate_up_proj)
            self.act_fn = cast(nn.Module, mlp.activation_fn)
            self.intermediate = int(cast(nn.Linear, lora_base(self.gate_up)).out_features) // 2
        else:
            self.gate_up = stacked([mlp.gate_proj, mlp.up_proj])  # type: ignore[list-item]
            self.act_fn = cast(nn.Module, mlp.act_fn)
            self.intermediate = int(mlp.gate_proj.out_features)  # type: ignore[union-attr, arg-type]
        self.down_proj = cast(nn.Module, mlp.down_proj)
        on_cpu = linear_input(self.gate_up)[2].type == "cpu"
        self.native = native_kernels() if is_silu(self.act_fn) and on_cpu else None
        """SiLU on CPU: the C++ ``silu_and_mul`` (one call for the two slices, the activation and the product)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.native is not None and not torch.compiler.is_compiling():
            product = self.native.silu_and_mul(gate_up)
            if product is not None:
                return self.down_proj(product)
        return self.down_proj(self.act_fn(gate_up[..., : self.intermediate]) * gate_up[..., self.intermediate :])


def _gated_mlp(module: nn.Module) -> bool:
    if all(hasattr(module, n) for n in ("gate_up_proj", "down_proj", "activation_fn")):  # Phi-3
        gate_up = module.gate_up_proj
        if not isinstance(gate_up, nn.Module) or not _fusable(gate_up, down=module.down_proj):
            return False  # experts' stacked weights (a parameter), quantized or sliced projections
        return cast(nn.Linear, lora_base(gate_up)).out_features % 2 == 0
    if not all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    gate, up = module.gate_proj, module.up_proj
    same_bias = len({cast(nn.Linear, lora_base(cast(nn.Module, m))).bias is None for m in (gate, up)}) == 1
    return _fusable(gate, up, down=module.down_proj) and same_bias and gate.out_features == up.out_features  # type: ignore[union-attr]


def _rotary_dim(attn: nn.Module) -> int:
    """RoPE's width per head: Phi's and GPT-NeoX's ``rotary_ndims``, GPT-J's ``rotary_dim``, the config's
    ``partial_rotary_factor`` of the head (Phi-3's, e.g. Phi-4-mini), else all of it."""
    explicit = getattr(attn, "rotary_ndims", None) or getattr(attn, "rotary_dim", None)
    if explicit:
        return int(explicit)
    config = getattr(attn, "config", None)
    factor = getattr(config, "partial_rotary_factor", None)
    if factor is None:
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    return int(head_dim_of(attn) * float(factor)) if factor else head_dim_of(attn)


class FusedPagedAttention(nn.Module):
    """Llama-form self-attention over the paged pool with one q/k/v GEMM and one RoPE pass (see module doc)."""

    o_proj: nn.Module

    def __init__(
        self,
        attn: nn.Module,
        layout: QkvLayout,
        *,
        scaling: float,
        sliding_window: int | None,
        softcap: float = 0.0,
        rope: str = "neox",
    ) -> None:
        super().__init__()
        self.rope = rope
        """Rotary kind: ``neox`` (halves), ``interleaved`` (pairs ``2i, 2i + 1``: Cohere), ``gptj`` (the same
        pairs, GPT-J's tables: :func:`rope_tables`) or ``none`` (GPT-2, GPT-BigCode, OPT: learned positions)."""
        self.layer_idx = int(attn.layer_idx)  # type: ignore[arg-type]
        self.head_dim = layout.head_dim
        self.num_q_heads, self.num_kv_heads = layout.num_q_heads, layout.num_kv_heads
        self.scaling = scaling
        self.sliding_window = sliding_window
        self.softcap = softcap
        """Attention logit soft-cap (Gemma 2), 0 for none."""
        self.qkv_proj = layout.projection
        self.o_proj = output_projection(attn)
        self.channel: Any = getattr(attn, "channel", None)
        """Our Falcon attention's :class:`~..model.falcon.StepChannel`: Falcon's layers pass no metadata down."""
        self.rotary_dim = _rotary_dim(attn)
        """RoPE on the first ``rotary_dim`` values of each head (Phi's partial rotary), the rest kept."""
        self.q_norm: nn.Module | None = getattr(attn, "q_norm", None)
        self.k_norm: nn.Module | None = getattr(attn, "k_norm", None)
        q_width = getattr(self.q_norm, "weight", torch.empty(0)).shape[-1]
        self.qk_norm_over_heads = self.num_q_heads > 1 and q_width == self.num_q_heads * self.head_dim
        """OLMo2's q/k norms: each over all query (key) heads of a token at once, not head by head."""
        on_cpu = linear_input(self.qkv_proj)[2].type == "cpu"
        self.native = native_kernels() if on_cpu else None
        """On CPU, RoPE runs as one C++ call (the same roundings as transformers' five tensor ops)."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        channel = self.channel.metadata if self.channel is not None else None
        metadata = channel if channel is not None else step_metadata(kwargs)
        tokens = hidden_states.shape[1]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden_states[0]).view(tokens, hq + 2 * hkv, d)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm_over_heads:
            q, k = self.q_norm(q.reshape(tokens, hq * d)), self.k_norm(k.reshape(tokens, hkv * d))
            qk = torch.cat([q.view(tokens, hq, d), k.view(tokens, hkv, d)], dim=1)
        elif self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        else:
            qk = qkv[:, : hq + hkv]
        if self.rope == "none":
            pass
        elif position_embeddings is None:
            raise ValueError(f"a {self.rope} rotary attention needs the model's position_embeddings")
        elif self.rotary_dim < d:
            cos, sin = rope_tables(position_embeddings, self.rope)
            qk = torch.cat((self._rope(qk[..., : self.rotary_dim], cos, sin), qk[..., self.rotary_dim :]), dim=-1)
        else:
            qk = self._rope(qk, *rope_tables(position_embeddings, self.rope))
        out = paged_attention(
            metadata,
            self.layer_idx,
            qk[:, :hq],
            qk[:, hq:],
            v,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
        )
        return self.o_proj(out.reshape(1, tokens, hq * d)), None

    def _rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """transformers' ``apply_rotary_pos_emb`` on the query and key heads at once (``cos``/``sin`` ``[T, D]``)."""
        if self.rope == "none":
            return qk
        if self.rope in ("interleaved", "gptj"):  # Cohere's computed in fp32 and rounded back, GPT-J's as it is
            x = qk.float() if self.rope == "interleaved" else qk
            pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
            return (x * cos.unsqueeze(1) + pairs * sin.unsqueeze(1)).to(qk.dtype)
        if self.native is not None and not torch.compiler.is_compiling():
            rotated = self.native.rope_neox(qk, cos, sin)
            if rotated is not None:
                return rotated
        half = qk.shape[-1] // 2
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (qk * cos) + (torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin)


@dataclass(frozen=True, slots=True)
class FusionReport:
    """What :func:`fuse_blocks` replaced (logged at start-up, asserted by the tests)."""

    mlps: int
    attentions: int
    kept: tuple[str, ...]
    """Class names of candidates that did not reproduce their original (left as they are)."""


def _fused_mlp(mlp: nn.Module, model_dtype: torch.dtype) -> FusedGatedMLP | None:
    """The fused form of ``mlp`` if it reproduces it on a random input, else ``None`` (also on any error: a
    forward of another signature keeps its module)."""
    fused = FusedGatedMLP(mlp)
    try:
        return fused if same_output(mlp, fused, *linear_input(fused.gate_up, model_dtype)) else None
    except Exception as e:  # noqa: BLE001 - any failure means: keep the original
        logger.debug("MLP {} not fused: {}: {}", type(mlp).__name__, type(e).__name__, e)
        return None


def _scratch_metadata(
    geometry: tuple[int, int], layer_idx: int, device: torch.device, block_size: int, kv_dtype: torch.dtype
) -> PagedAttentionMetadata:
    """One prefill of :data:`CHECK_TOKENS` tokens over fresh zeroed pools (``geometry``: KV heads, head_dim)."""
    blocks = -(-CHECK_TOKENS // block_size)
    batch = build_forward_batch([RequestChunk([0] * CHECK_TOKENS, 0, list(range(blocks)))], block_size)
    shape = (blocks, block_size, *geometry)
    pools = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(2)]
    layers = layer_idx + 1
    return PagedAttentionMetadata(batch.to(device), [pools[0]] * layers, [pools[1]] * layers, seen_options=[])


def _fused_attention(
    attn: nn.Module, block_size: int, kv_dtype: torch.dtype, model_dtype: torch.dtype
) -> FusedPagedAttention | None:
    """The fused form of ``attn`` if it reproduces it: the original runs once on a random prompt (random
    cos/sin) through the paged attention over scratch pools, recording the options it passes; the fused
    module is built with exactly those and must give the same output. ``None`` otherwise (or on any error:
    a forward of another signature keeps its module)."""
    layout = qkv_layout(attn)
    if layout is None:
        return None
    width, dtype, device = linear_input(layout.projection, model_dtype)
    geometry = (layout.num_kv_heads, layout.head_dim)
    tries = ROPE_TRIES.get(type(attn).__name__, ("neox",))
    table = rope_table_width(tries[0], _rotary_dim(attn))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, CHECK_TOKENS, width, generator=generator).to(dtype)
    cos, sin = (torch.randn(1, CHECK_TOKENS, table, generator=generator).to(dtype) for _ in range(2))
    try:
        with torch.inference_mode():
            metadata = _scratch_metadata(geometry, int(attn.layer_idx), device, block_size, kv_dtype)  # type: ignore[arg-type]
            expected = attn(x, position_embeddings=(cos, sin), attention_mask=None, **{METADATA_KWARG: metadata})[0]
            seen = metadata.seen_options or []
            if len(seen) != 1 or seen[0]["sinks"] or seen[0]["alibi"]:  # not one plain paged call
                return None
            options = seen[0]
            scaling = options["scaling"] * (float(attn.scaling) if type(attn).__name__ in QUERY_SCALED else 1.0)  # type: ignore[arg-type]
            for rope in tries:
                fused = FusedPagedAttention(
                    attn, layout, scaling=scaling, sliding_window=options["sliding_window"],
                    softcap=options["softcap"], rope=rope,
                )  # fmt: skip
                metadata = _scratch_metadata(geometry, fused.layer_idx, device, block_size, kv_dtype)
                got = fused(x, position_embeddings=(cos, sin), attention_mask=None, **{METADATA_KWARG: metadata})[0]
                if outputs_close(expected, got):
                    return fused
    except Exception as e:  # noqa: BLE001 - any failure means: keep the original
        logger.debug("attention {} not fused: {}: {}", type(attn).__name__, type(e).__name__, e)
    return None


def fuse_blocks(model: nn.Module, block_size: int, kv_dtype: torch.dtype) -> FusionReport:
    """Replace gated MLPs and Llama-form attentions of ``model`` in place (see the module docstring);
    the attention check runs over scratch pools of ``block_size`` and ``kv_dtype``."""
    linearize_conv1d(model)  # GPT-2's Conv1D projections as the nn.Linear they are (weights transposed once)
    model_dtype = compute_dtype(model) or torch.float32
    mlps = attentions = 0
    kept: set[str] = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            candidate: nn.Module | None
            if _gated_mlp(child):
                candidate = _fused_mlp(child, model_dtype)
                mlps += candidate is not None
            elif type(child).__name__ in LLAMA_FORM_ATTENTION:
                candidate = _fused_attention(child, block_size, kv_dtype, model_dtype)
                attentions += candidate is not None
            else:
                continue
            if candidate is None:
                kept.add(type(child).__name__)
            else:
                setattr(parent, name, candidate)
    report = FusionReport(mlps=mlps, attentions=attentions, kept=tuple(sorted(kept)))
    logger.info(
        "fused blocks: {} attentions (one q/k/v GEMM, one RoPE pass), {} gated MLPs (one gate/up GEMM){}",
        attentions,
        mlps,
        f"; kept {', '.join(report.kept)} (their forward differs)" if kept else "",
    )
    return report
