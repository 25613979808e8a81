"""Torch references of :mod:`.cpu_layer`'s native calls: the specification ``tests/kernels/test_cpu_layer.py``
compares the kernels with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_decode import decode_attention_math
from .cpu_layer import LayerForm, LayerWeights, norm_weight
from .cpu_layer_lora import LayerLora
from .lora import lora_delta_reference


def gemm_packed_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`gemm_packed` on the unpacked ``[N, K]`` weight: each output summed over ``k`` in
    order with fused multiply-adds, in float64 (the kernel's fp32 result lies within a few ulp of it)."""
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).float()


def gemm_packed_bf16_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, rounds_activations: bool
) -> torch.Tensor:
    """Reference of :func:`.cpu_gemm.gemm_packed` on a bf16 packing of ``weight`` ``[N, K]`` (rounded to bf16
    here), for the build's arithmetic (:attr:`NativeKernels.gemm_bf16_rounds_activations`).

    The widening path: :func:`gemm_packed_ref` on the bf16 weights. The ``vdpbf16ps`` path: the activations
    rounded to bf16 too, and per ``k`` pair the odd product added before the even one, each add
    rounded to fp32 (a product of two bf16 values is exact in fp32): the kernel's bits, denormals aside."""
    w = weight.detach().to(torch.bfloat16).float()
    if not rounds_activations:
        return gemm_packed_ref(x, w, bias)
    a = x.to(torch.bfloat16).float()
    if a.shape[1] % 2:  # the packing's zero pair member
        a, w = F.pad(a, (0, 1)), F.pad(w, (0, 1))
    out = torch.zeros(a.shape[0], w.shape[0])
    for k in range(0, a.shape[1], 2):
        out = out + a[:, k + 1, None] * w[None, :, k + 1]
        out = out + a[:, k, None] * w[None, :, k]
    return out if bias is None else out + bias


def _rms_ref(
    x: torch.Tensor, weight: torch.Tensor | None, kind: str, eps: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """transformers' RMSNorm (or LayerNorm, with ``bias`` if any) of ``kind`` over the last dimension (fp32)."""
    assert weight is not None
    if kind == "layer":
        return F.layer_norm(x, (x.shape[-1],), norm_weight(weight, kind), bias, eps)
    return F.rms_norm(x, (x.shape[-1],), norm_weight(weight, kind), eps)


def decode_layer_ref(
    weights: dict[str, torch.Tensor | None],
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
    rounds_activations: bool = False,
) -> torch.Tensor:
    """Reference of :func:`decode_layer` in torch ops, on the module's ``weights`` as :meth:`LayerWeights.pack`
    takes them (unpacked ``[N, K]`` projections, the norms' own weights): the decoder layer ``w.form``
    describes, over the paged pools (same arguments otherwise; writes the pools too, rounding to their dtype).
    Several rows per request (``query_start_loc``): each row is a one-token request of its own over its request's
    table, seeing the positions up to its own. LoRA: PEFT's delta of each row's adapter added to each target's
    output columns.

    fp32 arithmetic whatever the dtypes (a bf16 ``hidden`` is widened, the output rounded back to its dtype);
    ``rounds_activations``: each projection's input is rounded to bf16 first (a bf16-packed layer on an
    AVX512-BF16 build, :func:`gemm_packed_bf16_ref`)."""
    out_dtype, hidden = hidden.dtype, hidden.float()
    cos, sin = (None if t is None else t.float() for t in (cos, sin))

    def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16).float() if rounds_activations else x, weight, bias)

    form = w.form
    tokens, hq, hkv, d = hidden.shape[0], w.num_q_heads, w.num_kv_heads, w.head_dim

    def linear(x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = weights[name]
        assert weight is not None
        if bias is None and (form.o_bias if name == "o" else form.mlp_bias and name != "qkv"):
            bias = weights[f"{name}_bias"]
        out = project(x, weight, bias)
        for t in lora.targets if lora is not None else ():
            if t.projection == name and token_slots is not None:
                columns = slice(t.column, t.column + t.b_stack.shape[1])
                out[:, columns] += lora_delta_reference(x, token_slots, t.a_stack, t.b_stack, t.scales)
        return out

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        if name not in form.norms:
            return x
        return _rms_ref(x, weights[name], form.norm, form.eps, weights[f"{name}_bias"] if form.norm_bias else None)

    attn_in = norm(hidden, "attn_in")
    mlp_in = norm(hidden, "mlp_in") if form.mlp_in_norm else attn_in  # a parallel block's MLP input
    qkv = linear(attn_in, "qkv", weights.get("qkv_bias") if form.qkv_bias else None)
    qkv = qkv.view(tokens, hq + 2 * hkv, d)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    if form.qk_norm == "head":
        q, k = (_rms_ref(t, weights[n], form.qk_norm_kind, form.qk_eps) for t, n in ((q, "q_norm"), (k, "k_norm")))
    elif form.qk_norm == "all":
        q, k = (
            _rms_ref(t.reshape(tokens, -1), weights[n], form.qk_norm_kind, form.qk_eps).view(t.shape)
            for t, n in ((q, "q_norm"), (k, "k_norm"))
        )
    qk = torch.cat((q, k), dim=1)
    r = form.rotary_dim or d
    rot, half = qk[..., :r], r // 2
    if form.rope != "none":
        assert cos is not None and sin is not None
        c, s = cos[:, None], sin[:, None]
        if form.rope == "neox":
            rot = rot * c + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * s
        else:  # interleaved
            rot = rot * c + torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2) * s
    qk = torch.cat((rot, qk[..., r:]), dim=-1)
    k = qk[:, hq:]
    block_size, keep = k_cache.shape[1], slot_mapping >= 0  # negative slots: nothing written
    blocks, offsets = slot_mapping[keep] // block_size, slot_mapping[keep] % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)
    if query_start_loc is not None:  # row t of request b sees seq_lens[b] - (its rows after t) positions
        q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
        request = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
        after = query_start_loc[1:].long()[request] - 1 - torch.arange(tokens)
        block_tables, seq_lens = block_tables[request], seq_lens.long()[request] - after
    attn = decode_attention_math(
        qk[:, :hq], k_cache, v_cache, block_tables.long(), seq_lens, form.scale, form.softcap, form.window or None,
        None, 1.0, 1.0,
    )  # fmt: skip

    def add(h: torch.Tensor, y: torch.Tensor, name: str) -> torch.Tensor:
        if form.post_add_norms:
            return norm(h + y, name)
        return h + norm(y, name) * form.residual_scale

    hidden = add(hidden, linear(attn.reshape(tokens, hq * d), "o"), "attn_out")
    gate_up = linear(mlp_in if form.parallel else norm(hidden, "mlp_in"), "gate_up") if not form.experts else hidden
    gelu = "tanh" if form.activation == "gelu_tanh" else "none"

    def act(x: torch.Tensor) -> torch.Tensor:
        if form.activation == "relu":
            return F.relu(x)
        return F.silu(x) if form.activation == "silu" else F.gelu(x, approximate=gelu)

    if form.experts:
        moe_in = mlp_in if form.parallel else norm(hidden, "mlp_in")
        out = add(hidden, _moe_ref(weights, form, moe_in, act, project), "mlp_out")
    elif not form.gated:
        out = add(hidden, linear(act(gate_up), "down"), "mlp_out")
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        out = add(hidden, linear(act(gate) * up, "down"), "mlp_out")
    return out.to(out_dtype)


def _moe_ref(weights: dict[str, torch.Tensor | None], form: LayerForm, x: torch.Tensor, act, project) -> torch.Tensor:  # noqa: ANN001
    """transformers' Mixtral / Qwen3-MoE block: softmax of the router's logits, each token's top-k (renormalized
    when the form says so), each expert's gated MLP on its rows, weighted and added in expert order."""
    router, gate_up, down = (weights[n] for n in ("router", "gate_up", "down"))
    assert router is not None and gate_up is not None and down is not None
    probs = F.softmax(project(x, router).float(), dim=-1)
    top, index = torch.topk(probs, form.top_k, dim=-1)
    if form.norm_top_k:
        top = top / top.sum(dim=-1, keepdim=True)
    out = moe_experts_ref(x, index, top, gate_up, down, act, project)
    if form.shared_expert:
        shared_gate_up, shared_down, shared_gate = (
            weights[n] for n in ("shared_gate_up", "shared_down", "shared_gate")
        )
        assert shared_gate_up is not None and shared_down is not None and shared_gate is not None
        gate, up = project(x, shared_gate_up).chunk(2, dim=-1)
        out = out + F.sigmoid(project(x, shared_gate)) * project(act(gate) * up, shared_down)
    return out


def moe_experts_ref(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, act=F.silu, project=gemm_packed_ref,  # noqa: ANN001
) -> torch.Tensor:  # fmt: skip
    """Reference of :func:`.cpu_gemm.moe_experts` (and of :func:`_moe_ref`'s experts): each hit expert's gated MLP
    (``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]``, unpacked) on its rows, weighted, added in expert order."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tokens, slot = torch.where(top_k_index == e)
        if tokens.numel():
            gate, up = project(x[tokens], gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, tokens, project(act(gate) * up, down[e]) * top_k_weights[tokens, slot, None])
    return out
