"""The one-byte GEMM of the native CPU kernels (``tgi_paged_kernels.cpu_quant``, ``csrc/cpu_gemm_quant.h``) and the
native decode layer on int8 and fp8 e4m3 projections: against their torch references, bit for bit the fp32 packed
GEMM (layer) on the weight ``int_gemm.dequantize_int`` / ``fp8_gemm.dequantize_fp8`` gives for the same codes (the
per-op paths' weights; every e4m3 byte decoded exactly), rows independent of their batch, the same bits from its
AVX2 and scalar paths (the library's source compiled for x86-64-v3 and for baseline x86-64), and the layouts it
refuses."""

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
    FP8_NAN_CODES,
    PackedInt8,
    dequantized_int8,
    gemm_packed_int8,
    gemm_packed_int8_ref,
    pack_fp8,
    pack_int8,
    pack_int8_layer,
)
from tgi_paged_kernels.fp8_gemm import dequantize_fp8
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


def _fp8(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight quantized as ``--quantize fp8`` does (e4m3, one scale per output channel), with every byte
    but the two NaNs in its first rows (subnormals, zeros of both signs, the largest values)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    scale = weight.abs().amax(dim=1) / 448.0
    q = (weight / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    codes = torch.tensor([c for c in range(256) if c not in FP8_NAN_CODES], dtype=torch.uint8)
    every = codes[torch.arange(k * 2) % len(codes)].view(2, k)
    q[:2] = every.view(torch.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("m", [1, 7, 40])
def test_fp8_gemm_is_the_fp32_gemm_on_the_per_op_dequantized_weight(native, m) -> None:
    n, k = 70, 300
    q, scale = _fp8(n, k, seed=m)
    per_op = dequantize_fp8(q, scale, torch.float32)
    w = pack_fp8(q, scale)
    assert w.fp8 and torch.equal(dequantized_int8(w), per_op)  # each weight's value is the per-op path's
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(n)
    expected = gemm_packed(native, x, pack_weight(per_op), n, bias)
    assert torch.equal(gemm_packed_int8(native, x, w, bias), expected)
    ref = gemm_packed_int8_ref(x, w, bias)  # torch sums in another order
    torch.testing.assert_close(gemm_packed_int8(native, x, w, bias), ref, rtol=1e-4, atol=1e-4)


def test_every_fp8_byte_decodes_to_its_e4m3_value(native) -> None:
    """With ``x`` the identity, the GEMM's output is the decoded weight itself: every non-NaN byte, exactly."""
    q, scale = _fp8(16, 254, seed=9)
    scale = torch.ones(16)  # the decoded bytes themselves
    out = gemm_packed_int8(native, torch.eye(254), pack_fp8(q, scale))
    assert torch.equal(out.t(), q.float())


def test_pack_fp8_refuses_nan_bytes_and_other_layouts() -> None:
    q, scale = _fp8(16, 64)
    for nan in FP8_NAN_CODES:
        bad = q.clone()
        bad.view(torch.uint8)[3, 5] = nan
        with pytest.raises(ValueError, match="NaN"):
            pack_fp8(bad, scale)
    with pytest.raises(ValueError, match="one scale per output channel"):
        pack_fp8(q, scale.repeat(2))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        pack_fp8(q.view(torch.uint8), scale)


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
    q, scale = _fp8(37, 100, seed=8)
    w = pack_fp8(q, scale)
    fn = lib.tgi_paged_gemm_packed_f8
    fn.restype, fn.argtypes = (
        ctypes.c_int,
        [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, ctypes.c_int],
    )
    assert fn(x.data_ptr(), 100, 13, 100, w.codes.data_ptr(), None, w.scales.data_ptr(), 37, bias.data_ptr(), None, 0,
              out.data_ptr(), 37, 2) == 0  # fmt: skip
    assert torch.equal(out, gemm_packed_int8(native, x, w, bias))


def _quantize(weight: torch.Tensor) -> PackedInt8:
    """Per-output-channel symmetric int8 of an fp32 ``[N, K]`` weight (zero point 128), as an 8-bit GPTQ checkpoint
    of one group per channel holds it."""
    scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
    codes = (torch.round(weight / scale) + 128).clamp(0, 255).to(torch.uint8)
    return pack_int8(codes, scale, torch.full((weight.shape[0], 1), 128, dtype=torch.uint8))


def _quantize_fp8(weight: torch.Tensor) -> PackedInt8:
    scale = weight.abs().amax(dim=1).clamp_min(1e-8) / 448.0
    return pack_fp8((weight / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale)


@pytest.mark.parametrize("codes", ["int8", "fp8"])
@pytest.mark.parametrize("form_name", ["Llama", "Phi", "Gemma3", "GPT-BigCode"])
def test_int8_layer_is_the_fp32_layer_on_the_dequantized_weights(native, form_name, codes) -> None:
    """The native decode layer with int8 or fp8 projections (``weight_dtype`` 2, 3) gives, bit for bit, the fp32
    layer's output and K/V on the weights the codes stand for, and the torch reference's within its tolerance."""
    hq, hkv, d, form = FORMS[form_name]
    hidden, inter = 96, 160
    raw, _ = _layer(hq, hkv, d, hidden, inter, form)
    quantize = _quantize if codes == "int8" else _quantize_fp8
    projections = {name: quantize(raw[name]) for name in ("qkv", "o", "gate_up", "down")}
    dense = {**raw, **{name: dequantized_int8(w) for name, w in projections.items()}}
    heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    int8 = pack_int8_layer(form, raw, projections, **heads)
    fp32 = LayerWeights.pack(form, dense, **heads)
    assert int8.qkv.dtype == torch.uint8 and int8.qkv.numel() == fp32.qkv.numel()  # a quarter of the bytes
    assert int8.fp8_codes == (codes == "fp8") and int8.spec.weight_dtype == (3 if codes == "fp8" else 2)
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


def test_a_layer_of_int8_and_fp8_projections_is_refused() -> None:
    hq, hkv, d, form = FORMS["Llama"]
    raw, _ = _layer(hq, hkv, d, 64, 96, form)
    projections = {name: _quantize(raw[name]) for name in ("qkv", "o", "gate_up")}
    projections["down"] = _quantize_fp8(raw["down"])
    with pytest.raises(ValueError, match="mix int8 and fp8"):
        pack_int8_layer(form, raw, projections, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
