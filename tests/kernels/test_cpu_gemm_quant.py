"""The int8 GEMM of the native CPU kernels (``tgi_paged_kernels.cpu_quant``, ``csrc/cpu_gemm_quant.h``) and the native
decode layer on int8 projections: against their torch references, bit for bit the fp32 packed GEMM (layer) on the
weight ``int_gemm.dequantize_int`` gives for the same codes (the per-op int8 path's weight), rows independent of
their batch, the same bits from its AVX2 and scalar paths (the library's source compiled for x86-64-v3 and for
baseline x86-64), and the layouts it refuses."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from tests.kernels.test_cpu_layer import FORMS, _layer, _step
from tgi_paged_kernels.cpu_layer import LayerWeights, decode_layer, gemm_packed, pack_weight
from tgi_paged_kernels.cpu_layer_ref import decode_layer_ref
from tgi_paged_kernels.cpu_native import CSRC, FLAGS
from tgi_paged_kernels.cpu_quant import (
    PackedInt8,
    dequantized_int8,
    gemm_packed_int8,
    gemm_packed_int8_ref,
    pack_int8,
    pack_int8_layer,
)
from tgi_paged_kernels.int_gemm import dequantize_int


def _int8(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random 8-bit codes, per-channel fp32 scales and uint8 zero points (symmetric 128 and others)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, 1, generator=g) * 0.02 + 1e-3
    zeros = torch.where(torch.arange(n) % 3 == 0, 128, torch.randint(100, 156, (n,), generator=g)).to(torch.uint8)
    return codes, scales, zeros.view(n, 1)


@pytest.mark.parametrize(("m", "k", "n", "bias"), [(1, 128, 256, False), (20, 96, 160, True), (13, 100, 37, True),
                                                   (300, 64, 48, False)])  # fmt: skip
def test_int8_gemm_matches_the_reference(native, m, k, n, bias) -> None:
    codes, scales, zeros = _int8(n, k)
    w = pack_int8(codes, scales, zeros)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    b = torch.randn(n) if bias else None
    torch.testing.assert_close(gemm_packed_int8(native, x, w, b), gemm_packed_int8_ref(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 7, 40])
def test_int8_gemm_is_the_fp32_gemm_on_the_per_op_dequantized_weight(native, m) -> None:
    n, k = 70, 128
    codes, scales, zeros = _int8(n, k, seed=2)
    per_op = dequantize_int(codes, scales, zeros, torch.zeros(k, dtype=torch.int32), 8, torch.float32)
    w = pack_int8(codes, scales, zeros)
    assert torch.equal(dequantized_int8(w), per_op)  # each weight's value is the per-op path's
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(n)
    expected = gemm_packed(native, x, pack_weight(per_op), n, bias)
    assert torch.equal(gemm_packed_int8(native, x, w, bias), expected)


def test_int8_rows_do_not_depend_on_their_batch(native) -> None:
    codes, scales, zeros = _int8(48, 64, seed=4)
    w = pack_int8(codes, scales, zeros)
    x = torch.randn(30, 64, generator=torch.Generator().manual_seed(5))
    whole = gemm_packed_int8(native, x, w)
    assert torch.equal(torch.cat([gemm_packed_int8(native, x[i : i + 1], w) for i in range(30)]), whole)


def test_pack_int8_refuses_other_layouts() -> None:
    codes, scales, zeros = _int8(16, 64)
    with pytest.raises(ValueError, match="one scale and zero point per output channel"):
        pack_int8(codes, scales.repeat(1, 2), zeros.repeat(1, 2))  # two groups per channel
    with pytest.raises(ValueError, match="uint8 codes"):
        pack_int8(codes.to(torch.int32), scales, zeros)


def _isa_library(tmp_path, march: str) -> ctypes.CDLL:
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    flags = [f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS]
    target = tmp_path / f"quant-{march}.so"
    done = subprocess.run([compiler, *flags, str(CSRC / "cpu_quant.cpp"), "-o", str(target)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return ctypes.CDLL(str(target))


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 + FMA; baseline (the scalar path)
def test_other_isa_paths_build_and_give_the_same_bits(native, tmp_path, march) -> None:
    if march == "x86-64-v3" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU cannot run AVX2 code")
    lib = _isa_library(tmp_path, march)
    codes, scales, zeros = _int8(37, 100, seed=6)
    w: PackedInt8 = pack_int8(codes, scales, zeros)
    x, bias = torch.randn(13, 100, generator=torch.Generator().manual_seed(7)), torch.randn(37)
    out = torch.empty(13, 37)
    fn = lib.tgi_paged_gemm_packed_i8
    fn.restype = ctypes.c_int
    args = (x.data_ptr(), 100, 13, 100, w.codes.data_ptr(), w.zeros.data_ptr(), w.scales.data_ptr(), 37,
            bias.data_ptr(), None, 0, out.data_ptr(), 37, 2)  # fmt: skip
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, ctypes.c_int]
    assert fn(*args) == 0
    assert torch.equal(out, gemm_packed_int8(native, x, w, bias))


def _quantize(weight: torch.Tensor) -> PackedInt8:
    """Per-output-channel symmetric int8 of an fp32 ``[N, K]`` weight (zero point 128), as an 8-bit GPTQ checkpoint
    of one group per channel holds it."""
    scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
    codes = (torch.round(weight / scale) + 128).clamp(0, 255).to(torch.uint8)
    return pack_int8(codes, scale, torch.full((weight.shape[0], 1), 128, dtype=torch.uint8))


@pytest.mark.parametrize("form_name", ["Llama", "Phi", "Gemma3", "GPT-BigCode"])
def test_int8_layer_is_the_fp32_layer_on_the_dequantized_weights(native, form_name) -> None:
    """The native decode layer with int8 projections (``weight_dtype`` 2) gives, bit for bit, the fp32 layer's
    output and K/V on the weights the codes stand for, and the torch reference's within its tolerance."""
    hq, hkv, d, form = FORMS[form_name]
    hidden, inter = 96, 160
    raw, _ = _layer(hq, hkv, d, hidden, inter, form)
    projections = {name: _quantize(raw[name]) for name in ("qkv", "o", "gate_up", "down")}
    dense = {**raw, **{name: dequantized_int8(w) for name, w in projections.items()}}
    heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    int8 = pack_int8_layer(form, raw, projections, **heads)
    fp32 = LayerWeights.pack(form, dense, **heads)
    assert int8.qkv.dtype == torch.uint8 and int8.qkv.numel() == fp32.qkv.numel()  # a quarter of the bytes
    lengths = [1, 5, 17, 40, 33, 3]
    (k_pool, v_pool), tables, seq_lens, slots = _step(lengths, 4, hkv, d, torch.int64)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(lengths), hidden, generator=g)
    r = form.rotary_dim or d
    cos, sin = (None, None) if form.rope == "none" else (torch.randn(len(lengths), r, generator=g) for _ in range(2))
    pools = [(k_pool.clone(), v_pool.clone()) for _ in range(3)]
    got = decode_layer(native, int8, x, cos, sin, *pools[0], slots, tables, seq_lens)
    same = decode_layer(native, fp32, x, cos, sin, *pools[1], slots, tables, seq_lens)
    expected = decode_layer_ref(dense, fp32, x, cos, sin, *pools[2], slots, tables, seq_lens)
    assert got is not None and same is not None
    assert torch.equal(got, same) and torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pools[0][0], pools[2][0], rtol=1e-4, atol=1e-4)


def test_int8_layer_refuses_an_moe_form() -> None:
    hq, hkv, d, form = FORMS["Mixtral"]
    raw, _ = _layer(hq, hkv, d, 64, 96, form)
    with pytest.raises(ValueError, match="dense MLPs only"):
        pack_int8_layer(form, raw, {"qkv": _quantize(raw["qkv"])}, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
