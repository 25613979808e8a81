"""The int4/int8 dequantize-GEMM (Triton, under the interpreter) and the CPU path against the fp32 reference.

Shapes are tiny and not multiples of the tiles (M 1/5/33 rows against 16/64-row tiles, N 40 and K 72
against 64); groups of 8 (so a K tile spans several groups and the last one is cut), one group per
channel, and a shuffled act-order ``g_idx``; every code 0..2^bits-1 and zeros across the range occur.
"""

from __future__ import annotations

import pytest
import torch

from tgi_paged_kernels.int_gemm import (
    _launch_int_linear,
    dequantize_int,
    int_linear,
    int_linear_reference,
    int_linear_torch,
    pack_codes,
    unpack_codes,
)
from tgi_paged_kernels.testing import ATTENTION_TOLERANCES


def _case(m: int, n: int, k: int, bits: int, group: str, dtype: torch.dtype, with_bias: bool):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k + bits)
    maxq = (1 << bits) - 1
    groups = {"8": k // 8, "channel": 1, "act-order": k // 8}[group]
    g_idx = (torch.arange(k) * groups // k).to(torch.int32)
    if group == "act-order":
        g_idx = g_idx[torch.randperm(k, generator=g)].contiguous()
    codes = torch.randint(0, maxq + 1, (n, k), generator=g).to(torch.uint8)
    codes[0, : maxq + 1] = torch.arange(maxq + 1, dtype=torch.uint8)[:k]  # every code
    zeros = torch.randint(0, maxq + 1, (n, groups), generator=g).to(torch.uint8)
    scales = torch.rand(n, groups, generator=g) * torch.logspace(-4, -1, n).unsqueeze(1)  # 3 decades
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = (torch.randn(n, generator=g) * 0.1).to(dtype) if with_bias else None
    return x, pack_codes(codes, bits), scales, zeros, g_idx, bias, codes


def test_pack_and_unpack_are_inverse_and_int4_is_two_codes_per_byte():
    codes = torch.tensor([[1, 15, 0, 7]], dtype=torch.uint8)
    packed = pack_codes(codes, 4)
    assert packed.tolist() == [[0xF1, 0x70]]  # column 2j low nibble, 2j+1 high nibble
    assert torch.equal(unpack_codes(packed, 4), codes)
    assert torch.equal(pack_codes(codes, 8), codes)


def test_dequantize_is_code_minus_zero_times_scale_of_its_group():
    qweight = pack_codes(torch.tensor([[3, 9, 0, 15]], dtype=torch.uint8), 4)
    scales, zeros = torch.tensor([[0.5, 2.0]]), torch.tensor([[8, 1]], dtype=torch.uint8)
    g_idx = torch.tensor([1, 0, 0, 1], dtype=torch.int32)
    w = dequantize_int(qweight, scales, zeros, g_idx, 4, torch.float32)
    assert w.tolist() == [[(3 - 1) * 2.0, (9 - 8) * 0.5, (0 - 8) * 0.5, (15 - 1) * 2.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("bits, group", [(4, "8"), (4, "act-order"), (8, "channel")])
def test_triton_matches_reference(dtype, m, bits, group):
    x, qweight, scales, zeros, g_idx, bias, _ = _case(m, 40, 72, bits, group, dtype, m == 5)
    got = _launch_int_linear(x, qweight, scales, zeros, g_idx, bits, bias)
    want = int_linear_reference(x, qweight, scales, zeros, g_idx, bits, bias)
    if dtype != torch.float32:  # the contract: the weight rounded once to the activation dtype (as on CPU)
        weight = dequantize_int(qweight, scales, zeros, g_idx, bits, dtype).float()
        want = torch.nn.functional.linear(x.float(), weight, None if bias is None else bias.float())
    assert got.dtype == dtype and got.shape == (m, 40)
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


def test_triton_keeps_leading_dims_and_empty_batches():
    x, qweight, scales, zeros, g_idx, bias, _ = _case(6, 24, 32, 4, "8", torch.float32, True)
    x3 = x.reshape(2, 3, 32)
    got = _launch_int_linear(x3, qweight, scales, zeros, g_idx, 4, bias)
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(
        got.reshape(6, 24), int_linear_reference(x, qweight, scales, zeros, g_idx, 4, bias), atol=1e-5, rtol=1e-5
    )
    assert _launch_int_linear(x[:0], qweight, scales, zeros, g_idx, 4, bias).shape == (0, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_path_is_bit_identical_to_linear_over_the_dequantized_weight(dtype, bits):
    x, qweight, scales, zeros, g_idx, bias, _ = _case(5, 40, 72, bits, "act-order", dtype, True)
    weight = dequantize_int(qweight, scales, zeros, g_idx, bits, dtype)
    want = torch.nn.functional.linear(x, weight, bias)
    assert torch.equal(int_linear_torch(x, qweight, scales, zeros, g_idx, bits, bias), want)
    assert torch.equal(int_linear(x, qweight, scales, zeros, g_idx, bits, bias), want)  # CPU tensors: torch path


def test_bad_arguments_are_named():
    x, qweight, scales, zeros, g_idx, _, _ = _case(2, 16, 16, 4, "8", torch.float32, False)
    with pytest.raises(ValueError, match="bits=3"):
        int_linear(x, qweight, scales, zeros, g_idx, 3)
    with pytest.raises(ValueError, match="qweight"):
        int_linear(x, qweight.to(torch.int32), scales, zeros, g_idx, 4)
    with pytest.raises(ValueError, match="does not hold 16 8-bit"):
        int_linear(x, qweight, scales, zeros, g_idx, 8)
    with pytest.raises(ValueError, match="scales"):
        int_linear(x, qweight, scales.half(), zeros, g_idx, 4)
    with pytest.raises(ValueError, match="zeros"):
        int_linear(x, qweight, scales, zeros[:, :1], g_idx, 4)
    with pytest.raises(ValueError, match="input features"):
        int_linear(x[:, :8], qweight, scales, zeros, g_idx, 4)
