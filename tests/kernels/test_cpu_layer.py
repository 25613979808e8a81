"""The native decoder-layer kernels (``tgi_paged_kernels.cpu_layer``) against their torch references: the packed
GEMM, the whole decode layer of every form (Llama, Qwen3's q/k norms, Gemma's 1 + w norms and GeGLU, Gemma 2/3's
sandwich norms and soft-cap, OLMo2's post-norms, Granite's residual scale, Cohere's parallel block with LayerNorms
and interleaved RoPE, Phi's partial rotary, biases and ungated MLP; K/V written included), a row's result
independent of its batch, and the errors on bad inputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tgi_paged_kernels.cpu_layer import (
    LAYER_NORMS,
    LayerForm,
    LayerWeights,
    decode_layer,
    gemm_packed,
    pack_weight,
)
from tgi_paged_kernels.cpu_layer_ref import decode_layer_ref, gemm_packed_ref


@pytest.mark.parametrize(
    ("m", "k", "n", "bias"),
    [(1, 128, 256, False), (20, 128, 256, True), (13, 100, 37, True), (300, 64, 48, False), (25, 576, 960, False)],
)
def test_gemm_matches_the_reference(native, m, k, n, bias) -> None:
    """Row counts around the register tile (12 on AVX-512, 6 on AVX2), widths not a multiple of 16."""
    g = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = gemm_packed(native, x, pack_weight(w), n, b)
    expected = gemm_packed_ref(x, w, b)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5 * k**0.5)


def test_gemm_rows_do_not_depend_on_their_batch(native) -> None:
    """Every output is one sequential sum over k: a row gives the same bits alone and in any batch."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(29, 96, generator=g), torch.randn(70, 96, generator=g)
    packed = pack_weight(w)
    whole = gemm_packed(native, x, packed, 70)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 17), slice(28, 29)):
        assert torch.equal(gemm_packed(native, x[rows].contiguous(), packed, 70), whole[rows])


def test_pack_weight_refuses_other_kinds() -> None:
    with pytest.raises(ValueError, match="fp32"):
        pack_weight(torch.zeros(4, 4, dtype=torch.bfloat16))
    packed = pack_weight(torch.arange(6.0).view(3, 2))
    assert packed.shape == (1, 2, 16) and packed[0, :, :3].T.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert not packed[0, :, 3:].any()


def _layer(hq: int, hkv: int, d: int, hidden: int, inter: int, form: LayerForm, seed: int = 0):
    """Random module weights of ``form`` (norm weights around 1 for ``w``, around 0 for ``1 + w``) and their packing."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    def norm(width: int, kind: str):
        return torch.rand(width, generator=g) + (-0.5 if kind == "rms_1p" else 0.5)

    qk_width = {"head": (d, d), "all": (hq * d, hkv * d), "none": (0, 0)}[form.qk_norm]
    experts = (form.experts,) if form.experts else ()
    raw = dict(
        qkv=rand((hq + 2 * hkv) * d, hidden),
        qkv_bias=rand((hq + 2 * hkv) * d) if form.qkv_bias else None,
        o=rand(hidden, hq * d),
        gate_up=rand(*experts, (2 if form.gated else 1) * inter, hidden),
        down=rand(*experts, hidden, inter),
        router=rand(form.experts, hidden) * 10 if form.experts else None,  # well-separated top-k
        shared_gate_up=rand(2 * 40, hidden) if form.shared_expert else None,  # a shared expert 40 wide
        shared_down=rand(hidden, 40) if form.shared_expert else None,
        shared_gate=rand(1, hidden) * 5 if form.shared_expert else None,
        o_bias=rand(hidden),
        gate_up_bias=rand((2 if form.gated else 1) * inter),
        down_bias=rand(hidden),
        **{f"{name}_bias": rand(hidden) for name in LAYER_NORMS},
        **{name: norm(hidden, form.norm) for name in LAYER_NORMS},
        q_norm=norm(qk_width[0], form.qk_norm_kind) if qk_width[0] else None,
        k_norm=norm(qk_width[1], form.qk_norm_kind) if qk_width[1] else None,
    )
    return raw, LayerWeights.pack(form, raw, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)


def _step(lengths: list[int], block_size: int, kv_heads: int, d: int, index_dtype: torch.dtype, seed: int = 0):
    """Pools with random history, block tables (scattered blocks), the new tokens' slots."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = len(lengths) * width + 1
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = order[: len(lengths) * width].view(len(lengths), width).to(index_dtype)
    pools = [torch.randn(num_blocks, block_size, kv_heads, d, generator=g) for _ in range(2)]
    slots = torch.tensor(
        [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(lengths)]
    )
    return pools, tables, torch.tensor(lengths, dtype=index_dtype), slots


def _llama(d: int, **changes) -> LayerForm:
    return LayerForm(scale=d**-0.5, eps=1e-5, **changes)


FORMS = {
    # name: (hq, hkv, d, form)
    "Llama": (2, 1, 64, _llama(64)),  # the host-bound model's geometry
    "SmolLM2": (9, 3, 64, _llama(64)),
    "Mistral+Qwen2": (4, 2, 32, _llama(32, window=7, qkv_bias=True)),  # a window, q/k/v biases, generic head_dim
    "head_dim 128": (4, 4, 128, _llama(128)),
    "Qwen3": (4, 2, 64, _llama(64, qk_norm="head", qk_eps=1e-6)),
    "Gemma": (2, 1, 256, LayerForm(scale=0.0625, norm="rms_1p", activation="gelu_tanh")),
    "Gemma2": (
        4, 2, 32,
        LayerForm(
            scale=24**-0.5, norm="rms_1p", attn_out_norm=True, mlp_out_norm=True, activation="gelu_tanh",
            softcap=2.0, window=6,
        ),
    ),
    "Gemma3": (
        4, 2, 32,
        LayerForm(
            scale=16**-0.5, norm="rms_1p", attn_out_norm=True, mlp_out_norm=True, qk_norm="head",
            qk_norm_kind="rms_1p", activation="gelu_tanh", window=9,
        ),
    ),
    "OLMo2": (4, 2, 32, _llama(32, attn_in_norm=False, mlp_in_norm=False, attn_out_norm=True, mlp_out_norm=True,
                               qk_norm="all")),
    "Granite": (4, 2, 32, LayerForm(scale=0.2, residual_scale=0.5)),
    "Cohere": (4, 2, 32, _llama(32, norm="layer", mlp_in_norm=False, parallel=True, rope="interleaved")),
    "Cohere2 full": (4, 2, 32, _llama(32, norm="layer", mlp_in_norm=False, parallel=True, rope="none")),
    "LayerNorm sandwich": (4, 2, 32, _llama(32, norm="layer", attn_out_norm=True, mlp_out_norm=True)),
    "Phi": (
        4, 4, 32,
        _llama(32, norm="layer", norm_bias=True, mlp_in_norm=False, parallel=True, rotary_dim=16, gated=False,
               activation="gelu_tanh", qkv_bias=True, o_bias=True, mlp_bias=True),
    ),
    "GPT-NeoX": (
        4, 4, 16,
        _llama(16, norm="layer", norm_bias=True, parallel=True, rotary_dim=4, gated=False, activation="gelu",
               qkv_bias=True, mlp_bias=True),
    ),
    "GeGLU exact": (4, 2, 32, _llama(32, activation="gelu")),
    "GPT-BigCode": (  # multi-query: one KV head; learned positions: no RoPE
        4, 1, 32,
        _llama(32, norm="layer", norm_bias=True, rope="none", gated=False, activation="gelu_tanh", qkv_bias=True,
               o_bias=True, mlp_bias=True),
    ),
    "OPT": (
        4, 4, 16,
        _llama(16, norm="layer", norm_bias=True, rope="none", gated=False, activation="relu", qkv_bias=True,
               o_bias=True, mlp_bias=True),
    ),
    "OPT post-LN": (  # do_layer_norm_before=False: h = norm(h + block(h))
        4, 4, 16,
        _llama(16, norm="layer", norm_bias=True, rope="none", gated=False, activation="relu", qkv_bias=True,
               o_bias=True, mlp_bias=True, attn_in_norm=False, mlp_in_norm=False, attn_out_norm=True,
               mlp_out_norm=True, post_add_norms=True),
    ),
    "Falcon": (4, 2, 32, _llama(32, norm="layer", norm_bias=True, parallel=True, gated=False, activation="gelu")),
    "ReGLU": (4, 2, 32, _llama(32, activation="relu")),
    "Mixtral": (4, 2, 32, _llama(32, experts=5, top_k=2, norm_top_k=True, window=9)),  # MoE, renormalized top-k
    "Qwen3-MoE": (4, 2, 32, _llama(32, experts=6, top_k=3, qk_norm="head")),  # top-k weights as the softmax gave
    "Qwen2-MoE": (4, 2, 32, _llama(32, experts=4, top_k=2, shared_expert=True, qkv_bias=True)),  # + shared expert
    "LayerNorm+bias, partial interleaved": (
        4, 2, 32, _llama(32, norm="layer", norm_bias=True, mlp_out_norm=True, rotary_dim=8, rope="interleaved"),
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("form_name", "block_size", "index_dtype"),
    [
        ("Llama", 16, torch.int32),
        ("SmolLM2", 16, torch.int64),
        ("Mistral+Qwen2", 4, torch.int32),
        ("head_dim 128", 1, torch.int64),  # one token per block
        ("Qwen3", 16, torch.int32),
        ("Gemma", 16, torch.int64),
        ("Gemma2", 4, torch.int32),
        ("Gemma3", 4, torch.int64),
        ("OLMo2", 8, torch.int32),
        ("Granite", 16, torch.int32),
        ("Cohere", 4, torch.int64),  # parallel block, LayerNorm, interleaved RoPE
        ("Cohere2 full", 16, torch.int32),  # no RoPE
        ("LayerNorm sandwich", 8, torch.int32),
        ("Phi", 4, torch.int64),  # parallel, LayerNorm with bias, partial rotary, ungated GeLU MLP, biases
        ("LayerNorm+bias, partial interleaved", 16, torch.int32),
        ("GPT-NeoX", 4, torch.int32),  # parallel with two LayerNorms, exact GeLU
        ("GeGLU exact", 16, torch.int64),
        ("GPT-BigCode", 4, torch.int32),  # no RoPE: cos/sin not passed
        ("OPT", 16, torch.int64),  # ReLU MLP
        ("OPT post-LN", 4, torch.int32),  # norms after the residual add
        ("Falcon", 8, torch.int64),  # parallel with two LayerNorms, GQA
        ("ReGLU", 16, torch.int32),  # gated ReLU
        ("Mixtral", 4, torch.int64),  # router, top-2 of 5 experts (some hit by several tokens, some by none)
        ("Qwen3-MoE", 16, torch.int32),
        ("Qwen2-MoE", 8, torch.int64),  # plus a sigmoid-gated shared expert
    ],
)
def test_layer_matches_the_reference(native, form_name, block_size, index_dtype) -> None:
    hq, hkv, d, form = FORMS[form_name]
    hidden, inter = 96, 160
    raw, packed = _layer(hq, hkv, d, hidden, inter, form)
    lengths = [1, 5, 17, 40, 33, 3, 16]
    (k_pool, v_pool), tables, seq_lens, slots = _step(lengths, block_size, hkv, d, index_dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(lengths), hidden, generator=g)
    r = form.rotary_dim or d
    cos, sin = torch.randn(len(lengths), r, generator=g), torch.randn(len(lengths), r, generator=g)
    if form.rope == "none":  # learned positions: the model passes no tables
        cos = sin = None
    ref_k, ref_v, k_before = k_pool.clone(), v_pool.clone(), k_pool.clone()
    got = decode_layer(native, packed, x, cos, sin, k_pool, v_pool, slots, tables, seq_lens)
    expected = decode_layer_ref(raw, packed, x, cos, sin, ref_k, ref_v, slots, tables, seq_lens)
    # Four GEMMs summed in another order than torch's: within 1e-4 (the load-time check's tolerance).
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k_pool, ref_k, rtol=1e-4, atol=1e-4)  # normed, RoPE'd keys written to their slots
    torch.testing.assert_close(v_pool, ref_v, rtol=1e-4, atol=1e-4)
    assert (k_pool != k_before).any(dim=(1, 2, 3)).sum() == len(lengths)  # one slot per request, nothing else


def test_a_nan_router_gives_nan_as_transformers_does(native) -> None:
    """A NaN router weight makes every token's router logits NaN: the step's output is NaN, as the reference's (torch
    softmax and topk), not an expert read out of range or a silent zero."""
    hq, hkv, d, form = FORMS["Mixtral"]
    raw, _ = _layer(hq, hkv, d, 96, 160, form)
    raw["router"][3, 0] = float("nan")
    packed = LayerWeights.pack(form, raw, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    (k_pool, v_pool), tables, seq_lens, slots = _step([4, 9], 4, hkv, d, torch.int64)
    x, cs = torch.randn(2, 96, generator=torch.Generator().manual_seed(3)), torch.rand(2, d)
    got = decode_layer(native, packed, x, cs, cs, k_pool.clone(), v_pool.clone(), slots, tables, seq_lens)
    expected = decode_layer_ref(raw, packed, x, cs, cs, k_pool.clone(), v_pool.clone(), slots, tables, seq_lens)
    assert got is not None and torch.isnan(expected).all() and torch.isnan(got).all()


def test_each_part_of_the_form_changes_the_result(native) -> None:
    """The form is not ignored: flipping any one of its parts changes the step's output."""
    hq, hkv, d, base = FORMS["Gemma3"]
    raw, packed = _layer(hq, hkv, d, 64, 96, base)
    (k_pool, v_pool), tables, seq_lens, slots = _step([20, 11], 4, hkv, d, torch.int32)
    x, cs = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)), torch.rand(2, d)

    def run(form: LayerForm) -> torch.Tensor:
        w = LayerWeights.pack(form, raw, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        out = decode_layer(native, w, x, cs, cs, k_pool.clone(), v_pool.clone(), slots, tables, seq_lens)
        assert out is not None
        return out

    reference = run(base)
    changes = [
        dict(norm="rms"), dict(attn_in_norm=False), dict(attn_out_norm=False), dict(mlp_in_norm=False),
        dict(mlp_out_norm=False), dict(qk_norm="none"), dict(qk_norm_kind="rms"), dict(activation="silu"),
        dict(softcap=1.0), dict(window=0), dict(residual_scale=0.5), dict(scale=0.3), dict(eps=0.5),
        dict(qk_eps=0.5), dict(rope="interleaved"), dict(rope="none"), dict(activation="relu"),
        dict(post_add_norms=True),
    ]  # fmt: skip
    for change in changes:
        assert not torch.allclose(run(dataclasses.replace(base, **change)), reference, rtol=1e-3, atol=1e-3), change


def test_layer_weights_must_fit_their_form() -> None:
    raw, packed = _layer(2, 1, 16, 32, 48, FORMS["Gemma3"][3])
    with pytest.raises(ValueError, match="q_norm"):
        dataclasses.replace(packed, q_norm=None)
    with pytest.raises(ValueError, match="attn_out"):
        dataclasses.replace(packed, form=dataclasses.replace(packed.form, attn_out_norm=False))
    with pytest.raises(ValueError, match="needs 'qkv_bias'"):
        LayerWeights.pack(LayerForm(scale=1.0, qkv_bias=True), raw, num_q_heads=2, num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="activation"):
        LayerForm(scale=1.0, activation="swish")
    with pytest.raises(ValueError, match="parallel"):  # both blocks add to h at once: no post-norm
        LayerForm(scale=1.0, parallel=True, attn_out_norm=True)
    with pytest.raises(ValueError, match="experts"):
        LayerForm(scale=1.0, experts=4, top_k=5)
    with pytest.raises(ValueError, match="not a packed"):  # an MoE form needs each expert's and the router's packs
        dataclasses.replace(packed, form=dataclasses.replace(packed.form, experts=2, top_k=1))
    with pytest.raises(ValueError, match="after the residual add"):
        LayerForm(scale=1.0, post_add_norms=True, residual_scale=0.5)
    # Gemma's 1 + w is folded into the packed norm weight, as transformers rounds it
    assert torch.equal(packed.attn_in, 1.0 + raw["attn_in"])


def test_layer_refuses_a_slot_outside_the_pool(native) -> None:
    raw, packed = _layer(2, 1, 64, 128, 64, _llama(64))
    (k_pool, v_pool), tables, seq_lens, slots = _step([4, 9], 16, 1, 64, torch.int32)
    x, cs = torch.randn(2, 128), torch.randn(2, 64)
    bad = slots.clone()
    bad[1] = k_pool.shape[0] * 16
    with pytest.raises(ValueError, match="slot outside the pool's"):
        decode_layer(native, packed, x, cs, cs, k_pool, v_pool, bad, tables, seq_lens)
    # inputs of another kind: None, and the caller runs the per-op path
    assert decode_layer(native, packed, x.double(), cs, cs, k_pool, v_pool, slots, tables, seq_lens) is None
    assert decode_layer(native, packed, x, cs, cs, k_pool, v_pool, slots.int(), tables, seq_lens) is None
    with pytest.raises(ValueError, match="blocks"):  # a seq_len beyond the table's width
        decode_layer(native, packed, x, cs, cs, k_pool, v_pool, slots, tables, seq_lens * 10)
