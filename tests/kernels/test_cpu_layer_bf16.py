"""The bf16 side of the native decoder layer (``tgi_paged_kernels.cpu_gemm``, ``csrc/cpu_gemm_bf16.h``,
``cpu_layer.decode_layer`` with bf16 weights, hidden state and pools) against its torch references, on this host's
build (each of its paths: widening, ``vdpbf16ps``, AMX, switched in one process) and an AVX2-only build
(``-march=x86-64-v3``), loaded beside it.

Tolerances, derived: the GEMM's reference models the build's arithmetic (:func:`gemm_packed_bf16_ref`): where the
weights are widened (the default), the fp32 GEMM on the widened weights gives the same bits, and the float64
reference is met within the fp32 GEMM's tolerance; the ``vdpbf16ps`` path meets its reference bit for bit.
The layer's reference is the fp32 reference on the bf16-rounded weights (activations rounded before each projection
where the build rounds them): both sum in fp32 in other orders (1e-4, the fp32 test's tolerance), then round the
output and the K/V to bf16, where a sum that close to a rounding boundary can land one bf16 ulp (up to 2^-7
relative) away.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.kernels.test_cpu_layer import FORMS, _layer, _step
from tests.kernels.test_cpu_layer_lora import HIDDEN as LORA_HIDDEN
from tests.kernels.test_cpu_layer_lora import INTER as LORA_INTER
from tests.kernels.test_cpu_layer_lora import _lora
from tgi_paged_kernels import cpu_native
from tgi_paged_kernels.cpu_gemm import (
    gemm_packed,
    pack_weight,
    pack_weight_bf16,
    set_bf16_amx,
    set_bf16_dot,
    unpack_weight,
)
from tgi_paged_kernels.cpu_layer import LayerWeights, decode_layer
from tgi_paged_kernels.cpu_layer_ref import decode_layer_ref, gemm_packed_bf16_ref

SHAPES = [
    (1, 128, 256, False), (2, 101, 40, True), (6, 128, 256, False), (11, 64, 48, True), (20, 128, 256, True),
    (13, 101, 37, True), (300, 64, 48, False), (7, 576, 960, False),
]  # fmt: skip
"""(M, K, N, bias): rows around the register tiles, an odd K (a zero pair member), N not a multiple of 16."""
BF16_ULP = 2.0**-7
"""One bf16 ulp, relative: 2^-7 at the bottom of a binade (7 stored mantissa bits), 2^-8 at its top."""


def _check_gemm(native: cpu_native.NativeKernels, m: int, k: int, n: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = gemm_packed(native, x, pack_weight_bf16(w), n, b)
    rounds = native.gemm_bf16_rounds_activations
    expected = gemm_packed_bf16_ref(x, w, b, rounds_activations=rounds)
    if set_bf16_amx(native):  # AMX tiles: fp32 sums in the tiles' order (test_cpu_gemm_amx bounds them tighter)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5 * k**0.5)
    elif rounds:
        assert torch.equal(got, expected)
    else:  # the fp32 GEMM on the widened weights: the same fused multiply-adds in the same order
        widened = w.to(torch.bfloat16).float()
        assert torch.equal(got, gemm_packed(native, x, pack_weight(widened), n, b))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5 * k**0.5)


@contextlib.contextmanager
def bf16_path(native: cpu_native.NativeKernels, path: str) -> Iterator[None]:
    """The bf16 GEMM's ``path`` (``widening``, ``dot``: vdpbf16ps, ``amx``) switched on while the block runs (a
    skip where this host or build lacks it), the switches restored after."""
    dot_default = set_bf16_dot(native)
    try:
        if set_bf16_amx(native, path == "amx") != (path == "amx"):
            pytest.skip("no AMX-BF16 tiles here (CPU, build or kernel)")
        if set_bf16_dot(native, path == "dot") != (path == "dot"):
            pytest.skip("no AVX512-BF16 in this build")
        yield
    finally:
        set_bf16_amx(native, True)
        set_bf16_dot(native, dot_default)


@pytest.mark.parametrize("path", ["widening", "dot", "amx"])
@pytest.mark.parametrize(("m", "k", "n", "bias"), SHAPES)
def test_bf16_gemm_matches_the_reference(native, m, k, n, bias, path) -> None:
    with bf16_path(native, path):
        assert native.gemm_bf16_rounds_activations == (path != "widening")
        _check_gemm(native, m, k, n, bias)


def test_bf16_gemm_rows_do_not_depend_on_their_batch(native) -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(29, 96, generator=g), torch.randn(70, 96, generator=g)
    packed = pack_weight_bf16(w)
    whole = gemm_packed(native, x, packed, 70)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 17), slice(28, 29)):
        assert torch.equal(gemm_packed(native, x[rows].contiguous(), packed, 70), whole[rows])


def test_bf16_packing_layout_and_unpacking() -> None:
    w = torch.arange(15.0).view(3, 5)  # K odd: the last pair's second member is a zero
    packed = pack_weight_bf16(w)
    assert packed.shape == (1, 3, 16, 2) and packed.dtype == torch.bfloat16
    assert packed[0, :, 1].flatten().tolist() == [5, 6, 7, 8, 9, 0]  # column 1: its k pairs side by side
    assert not packed[0, :, 3:].any()
    assert torch.equal(unpack_weight(packed, 3, 5), w.to(torch.bfloat16))
    big = torch.randn(40, 66)
    assert torch.equal(unpack_weight(pack_weight_bf16(big), 40, 66), big.to(torch.bfloat16))
    assert torch.equal(unpack_weight(pack_weight(big), 40, 66), big)
    with pytest.raises(ValueError, match="does not fit"):  # an fp32 packing is not read as bf16, nor K mismatched
        gemm_packed(cpu_native.native_kernels(), torch.randn(2, 64), pack_weight_bf16(big), 40)


def _bf16_layer(form_name: str, hidden: int = 96, inter: int = 160):
    """A layer of ``FORMS[form_name]`` whose projections are bf16 values: fp32 weights (for the reference, the
    norms fp32 as the native layer keeps them) and the bf16-packed weights."""
    hq, hkv, d, form = FORMS[form_name]
    raw, _ = _layer(hq, hkv, d, hidden, inter, form)
    projections = ("qkv", "o", "gate_up", "down", "router", "shared_gate_up", "shared_down", "shared_gate")
    rounded = {n: t.to(torch.bfloat16).float() if n in projections and t is not None else t for n, t in raw.items()}
    fp32 = LayerWeights.pack(form, rounded, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    return rounded, fp32.as_bf16(), (hq, hkv, d, form)


@pytest.mark.parametrize(
    ("form_name", "kv_dtype"),
    [
        ("Llama", torch.bfloat16),
        ("SmolLM2", torch.float32),  # a bf16 model over an fp32 pool
        ("Qwen3", torch.bfloat16),
        ("Gemma3", torch.bfloat16),  # sandwich norms, 1 + w, q/k norms, GeGLU, a window
        ("Phi", torch.bfloat16),  # biases, LayerNorms with bias, partial rotary, ungated MLP
        ("GPT-BigCode", torch.bfloat16),  # no RoPE: no tables
        ("Mixtral", torch.bfloat16),  # the experts' bf16 packings one after another
        ("Qwen2-MoE", torch.bfloat16),  # plus the shared expert's
    ],
)
def test_bf16_layer_matches_the_reference(native, form_name, kv_dtype) -> None:
    rounded, w, (hq, hkv, d, form) = _bf16_layer(form_name)
    lengths = [1, 5, 17, 40, 33, 3, 16]
    (k_pool, v_pool), tables, seq_lens, slots = _step(lengths, 4, hkv, d, torch.int64)
    k_pool, v_pool = k_pool.to(kv_dtype), v_pool.to(kv_dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(lengths), 96, generator=g).to(torch.bfloat16)
    r = form.rotary_dim or d
    cos, sin = (torch.randn(len(lengths), r, generator=g).to(torch.bfloat16) for _ in range(2))
    if form.rope == "none":
        cos = sin = None
    ref_k, ref_v, k_before = k_pool.clone(), v_pool.clone(), k_pool.clone()
    got = decode_layer(native, w, x, cos, sin, k_pool, v_pool, slots, tables, seq_lens)
    rounds = native.gemm_bf16_rounds_activations
    expected = decode_layer_ref(
        rounded, w, x, cos, sin, ref_k, ref_v, slots, tables, seq_lens, rounds_activations=rounds
    )
    assert got is not None and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=BF16_ULP, atol=1e-4)
    kv_tol = BF16_ULP if kv_dtype == torch.bfloat16 else 1e-4  # an fp32 pool holds the fp32 sums
    torch.testing.assert_close(k_pool.float(), ref_k.float(), rtol=kv_tol, atol=1e-4)
    torch.testing.assert_close(v_pool.float(), ref_v.float(), rtol=kv_tol, atol=1e-4)
    assert (k_pool != k_before).any(dim=(1, 2, 3)).sum() == len(lengths)


def test_bf16_layer_is_not_the_fp32_layer(native) -> None:
    """The bf16 packing is read as bf16: the step's output differs from the fp32 layer's on unrounded weights by
    about bf16's precision, not by nothing and not by a wrong layout's O(1)."""
    hq, hkv, d, form = FORMS["Llama"]
    raw, fp32 = _layer(hq, hkv, d, 96, 160, form)
    (k_pool, v_pool), tables, seq_lens, slots = _step([9, 30], 16, hkv, d, torch.int32)
    x, cs = torch.randn(2, 96), torch.rand(2, d)
    exact = decode_layer(native, fp32, x, cs, cs, k_pool.clone(), v_pool.clone(), slots, tables, seq_lens)
    bf16 = decode_layer(native, fp32.as_bf16(), x, cs, cs, k_pool.clone(), v_pool.clone(), slots, tables, seq_lens)
    assert exact is not None and bf16 is not None and bf16.dtype == torch.float32
    gap = (bf16 - exact).abs().max().item()
    assert 0 < gap < 0.05 * exact.abs().max().item()


def _check_build(lib: cpu_native.NativeKernels) -> None:
    """``lib``'s bf16 GEMM at :data:`SHAPES` and a bf16 Llama-form layer step against their references."""
    for shape in SHAPES:
        _check_gemm(lib, *shape)
    rounded, w, (_, hkv, d, _) = _bf16_layer("Llama")
    (k_pool, v_pool), tables, seq_lens, slots = _step([4, 21], 4, hkv, d, torch.int32)
    k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
    x, cs = torch.randn(2, 96).bfloat16(), torch.rand(2, d).bfloat16()
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    got = decode_layer(lib, w, x, cs, cs, k_pool, v_pool, slots, tables, seq_lens)
    rounds = lib.gemm_bf16_rounds_activations
    expected = decode_layer_ref(rounded, w, x, cs, cs, ref_k, ref_v, slots, tables, seq_lens, rounds_activations=rounds)
    assert got is not None
    torch.testing.assert_close(got.float(), expected.float(), rtol=BF16_ULP, atol=1e-4)


def test_avx2_build_bf16_gemm_matches_the_reference(tmp_path, monkeypatch) -> None:
    """The library builds for an AVX2-only CPU (``-march=x86-64-v3``: the widening bf16 path on 8 lanes, no
    AVX-512), and that build's bf16 GEMM and bf16 layer step match their references (this host runs AVX2 code)."""
    monkeypatch.setenv("TGI_PAGED_KERNEL_CACHE", str(tmp_path / "kernels"))
    try:
        path = cpu_native.build_library(arch="x86-64-v3")
    except RuntimeError as e:
        pytest.skip(f"no compiler for x86-64-v3 here: {e}")
    avx2 = cpu_native.NativeKernels(path)
    assert not avx2.gemm_bf16_rounds_activations and not set_bf16_amx(avx2, True)  # no AMX code in that build
    _check_build(avx2)


@pytest.mark.parametrize("path", ["widening", "dot"])
def test_each_bf16_path_serves_the_layer_step(native, path) -> None:
    """The layer step on the widening and the vdpbf16ps GEMM (switched in one process) against the reference of
    that arithmetic, SmolLM2's projection shapes at 20 rows included."""
    with bf16_path(native, path):
        _check_build(native)
        _check_gemm(native, 20, 576, 3072, False)
        _check_gemm(native, 20, 1536, 576, True)


def test_the_dot_path_is_on_by_default_on_amd_cores_only(tmp_path) -> None:
    """A fresh library (its own process state) starts with vdpbf16ps on where the CPU is AMD's and the build has
    AVX512-BF16 (1.7x the widening path there), off on other vendors' cores (slower there)."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    code = (
        "import sys; from pathlib import Path; from tgi_paged_kernels import cpu_native; "
        "from tgi_paged_kernels.cpu_gemm import set_bf16_dot; "
        "print(int(set_bf16_dot(cpu_native.NativeKernels(Path(sys.argv[1])))))"
    )
    native = cpu_native.native_kernels()
    assert native is not None
    out = subprocess.run([sys.executable, "-c", code, str(native.path)], capture_output=True, text=True, check=True)
    built = "avx512_bf16" in cpuinfo  # -march=native: the build has it where the CPU does
    assert out.stdout.strip() == str(int(built and "AuthenticAMD" in cpuinfo))


def test_bf16_lora_rows_match_the_reference(native) -> None:
    """A bf16 hidden state with adapter rows: the deltas are added in fp32 inside the step (rows of another adapter,
    and of none, in one batch), as the reference adds them; rows without an adapter are the base step's."""
    rounded, w, (hq, hkv, d, form) = _bf16_layer("Llama", hidden=LORA_HIDDEN, inter=LORA_INTER)
    (k_pool, v_pool), tables, seq_lens, slots = _step([3, 9, 6], 4, hkv, d, torch.int32)
    k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, LORA_HIDDEN, generator=g).bfloat16()
    cos, sin = (torch.randn(3, d, generator=g).bfloat16() for _ in range(2))
    lora, token_slots = _lora(hq, hkv, d, form.gated), torch.tensor([0, -1, 1])
    pools = (k_pool.clone(), v_pool.clone())
    got = decode_layer(native, w, x, cos, sin, *pools, slots, tables, seq_lens, None, lora, token_slots)
    ref_pools = (k_pool.clone(), v_pool.clone())
    rounds = native.gemm_bf16_rounds_activations
    expected = decode_layer_ref(
        rounded, w, x, cos, sin, *ref_pools, slots, tables, seq_lens,
        lora=lora, token_slots=token_slots, rounds_activations=rounds,
    )  # fmt: skip
    assert got is not None and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=BF16_ULP, atol=1e-4)
    for pool, ref in zip(pools, ref_pools):
        torch.testing.assert_close(pool.float(), ref.float(), rtol=BF16_ULP, atol=1e-4)
    base = decode_layer(native, w, x, cos, sin, k_pool.clone(), v_pool.clone(), slots, tables, seq_lens)
    assert base is not None and torch.equal(got[1], base[1]) and not torch.equal(got[0], base[0])
