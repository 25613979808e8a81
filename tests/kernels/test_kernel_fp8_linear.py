"""The FP8 dequantize-GEMM (Triton, under the interpreter) and the CPU path against the fp32 reference.

Shapes are tiny and deliberately not multiples of the tiles (M 1/5/33 rows against 16/64-row tiles,
N 40 and K 72 against 64), weights cover every e4m3 code that the quantizer can produce including
subnormals and +-448, and one output channel is all zeros (scale at its floor).
"""

from __future__ import annotations

import pytest
import torch

from tgi_paged_backend.runner.quant.fp8 import quantize_fp8_per_channel
from tgi_paged_kernels.fp8_gemm import (
    _launch_fp8_linear,
    dequantize_fp8,
    fp8_linear,
    fp8_linear_reference,
    fp8_linear_torch,
)
from tgi_paged_kernels.testing import ATTENTION_TOLERANCES

# Same (atol, rtol) budget per activation dtype as the attention kernels: fp32 "ieee" dots differ from
# the reference only in summation order; fp16/bf16 round the activations and the output once each.
TOLERANCES = ATTENTION_TOLERANCES


def _case(m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    weight = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1)  # scales over 4 decades
    weight[3] = 0.0  # an all-zero channel
    qweight, scale = quantize_fp8_per_channel(weight)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = (torch.randn(n, generator=g) * 0.1).to(dtype) if with_bias else None
    return x, qweight, scale, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_matches_reference(dtype, m, with_bias):
    x, qweight, scale, bias = _case(m, 40, 72, dtype, with_bias)
    got = _launch_fp8_linear(x, qweight, scale, bias)
    want = fp8_linear_reference(x, qweight, scale, bias)
    assert got.dtype == dtype and got.shape == (m, 40)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


def test_triton_keeps_leading_dims_and_reads_every_code():
    # Every finite e4m3 byte once as a weight (NaN codes 0x7F/0xFF excluded): the in-kernel bit decode
    # must agree with torch's cast for all of them, since x is one-hot per column block.
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    qweight = codes.view(torch.float8_e4m3fn).reshape(2, -1)[:, :127].contiguous()  # [2, 127]
    scale = torch.ones(2)
    x = torch.eye(127).reshape(1, 127, 127)
    got = _launch_fp8_linear(x, qweight, scale)
    assert got.shape == (1, 127, 2)
    assert torch.equal(got[0].T, qweight.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_is_a_linear_over_the_dequantized_weight(dtype):
    x, qweight, scale, bias = _case(7, 24, 48, dtype, True)
    got = fp8_linear(x, qweight, scale, bias)  # CPU tensors: the torch path
    assert torch.equal(got, torch.nn.functional.linear(x, dequantize_fp8(qweight, scale, dtype), bias))
    assert torch.equal(got, fp8_linear_torch(x, qweight, scale, bias))
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), fp8_linear_reference(x, qweight, scale, bias), atol=atol, rtol=rtol)


def test_bad_arguments_are_named():
    x, qweight, scale, _ = _case(2, 16, 16, torch.float32, False)
    with pytest.raises(ValueError, match="qweight"):
        fp8_linear(x, qweight.float(), scale)
    with pytest.raises(ValueError, match="scale"):
        fp8_linear(x, qweight, scale[:3])
    with pytest.raises(ValueError, match="input features"):
        fp8_linear(x[:, :8], qweight, scale)
