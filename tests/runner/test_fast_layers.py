"""The load-time layer swap (``runner.cpu.fast_layers``): packed linears compute what ``nn.Linear`` does for
any batch size, RMSNorms are swapped only when the fused form reproduces them, and small or unsupported
linears stay as they are. (Token-exactness of every family through the swap: test_family_matrix.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.fixtures import SERVING_PACK_MIN_ELEMENTS
from tgi_paged_backend.runner.cpu import fast_layers
from tgi_paged_backend.runner.cpu.fast_layers import FusedRMSNorm, PackedLinear, can_pack, swap_fast_layers

CPU = torch.device("cpu")


class LlamaFormRMSNorm(nn.Module):
    """transformers' Llama RMSNorm, as written there (fp32 math, weight times the normalised input)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class GemmaFormRMSNorm(LlamaFormRMSNorm):
    """Gemma's variant scales by ``1 + weight``: not the fused form, so it must be kept."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(512, 384, bias=True)
        self.small = nn.Linear(8, 8, bias=False)
        self.norm = LlamaFormRMSNorm(384)
        self.gemma_norm = GemmaFormRMSNorm(384)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (1, 33, 96), (2, 5, 96)])
def test_packed_linear_matches_nn_linear_for_any_batch(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed.packed_weight.is_mkldnn


def test_swap_packs_big_linears_keeps_small_ones_and_checks_norm_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_layers, "PACK_MIN_ELEMENTS", SERVING_PACK_MIN_ELEMENTS)  # (the suite lowers it)
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(3, 512)
    with torch.inference_mode():
        expected = block.gemma_norm(block.norm(block.big(x)))
    report = swap_fast_layers(block, CPU, torch.float32)
    assert isinstance(block.big, PackedLinear) and block.big.plain_weight is None  # 512*384 >= 2^17: always packed
    assert isinstance(block.small, PackedLinear) and block.small.plain_below_rows == fast_layers.PACKED_MIN_ROWS
    assert isinstance(block.norm, FusedRMSNorm) and isinstance(block.gemma_norm, GemmaFormRMSNorm)
    assert (report.packed_linears, report.fused_norms, report.kept_norms) == (2, 1, ("GemmaFormRMSNorm",))
    with torch.inference_mode():
        torch.testing.assert_close(block.gemma_norm(block.norm(block.big(x))), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 127, 128, 300])
def test_a_small_weight_runs_plain_below_the_row_threshold_and_packed_from_it(rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    small = PackedLinear(linear, plain_below_rows=128)
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        torch.testing.assert_close(small(x), linear(x), rtol=1e-5, atol=1e-5)
    assert small.resident_bytes == 2 * 64 * 48 * 4  # the plain weight is kept beside the packed one


def test_packed_weights_count_as_resident_bytes_and_the_plain_weight_is_dropped() -> None:
    from tgi_paged_backend.runner.model.loader import resident_bytes

    block = nn.Sequential(nn.Linear(512, 384, bias=False))
    before = resident_bytes(block)
    swap_fast_layers(block, CPU, torch.float32)
    assert not any(p.shape == (384, 512) for p in block.parameters())
    assert resident_bytes(block) == before  # same elements, now in the reordered buffer


def test_nothing_is_packed_on_cuda_or_without_onednn_support() -> None:
    assert not can_pack(torch.float32, torch.device("cuda"))
    block = Block()
    report = swap_fast_layers(block, torch.device("meta"), torch.float32)  # not CPU: linears untouched
    assert report.packed_linears == 0 and type(block.big) is nn.Linear


def test_a_linear_of_another_dtype_is_left_alone() -> None:
    block = Block()
    block.big = block.big.to(torch.bfloat16)
    swap_fast_layers(block, CPU, torch.float32)
    assert type(block.big) is nn.Linear


def test_outputs_close_is_relative_to_the_output_scale() -> None:
    """A fused GEMM's rounding on a large output passes even where an element is near zero (SmolLM2's MLPs
    failed an element-wise check on 9 of 30 layers); a different function or a NaN does not."""
    from tgi_paged_backend.runner.cpu.fast_layers import outputs_close

    expected = torch.tensor([[900.0, -1.0e-3, 250.0]])
    assert outputs_close(expected, expected + torch.tensor([[6e-5, 3e-5, -3e-5]]))
    assert not outputs_close(expected, expected * 1.001)  # 0.9 off on 900: another computation
    assert not outputs_close(expected, torch.tensor([[900.0, float("nan"), 250.0]]))
    assert not outputs_close(expected, expected[:, :2])
    small = torch.tensor([1e-3, 2e-3])  # scale floor 1: absolute 1e-5
    assert outputs_close(small, small + 5e-6) and not outputs_close(small, small + 5e-5)
    half = expected.half()
    assert outputs_close(half, (expected * 1.001).half()) and not outputs_close(half, (expected * 1.1).half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wrong_norm_form_is_rejected_even_beside_one_huge_channel(dtype) -> None:
    """A Gemma norm (``x_hat * (1 + w)``) is not ``w * x_hat``, however large one channel of ``w`` is."""
    width = 2304
    weight = torch.zeros(width)
    weight[7] = 400.0
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    x_hat = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    gemma, wrong = (x_hat * (1 + weight)).to(dtype), (x_hat * weight).to(dtype)
    from tgi_paged_backend.runner.cpu.fast_layers import outputs_close

    assert not outputs_close(gemma, wrong)
    assert outputs_close(gemma, gemma.clone())


@pytest.mark.parametrize("bias", [True, False])
def test_a_wide_fp32_linear_runs_the_native_gemm_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, bias: bool
) -> None:
    from tgi_paged_backend.runner.cpu.fast_layers import NativeLinear
    from tgi_paged_kernels import native_kernels

    if native_kernels() is None:
        pytest.skip("native kernels not built here")
    monkeypatch.setattr(fast_layers, "NATIVE_MIN_OUT_FEATURES", 300)  # the LM head's role, at a test's size
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(72, 310, bias=bias), nn.Linear(72, 200))
    x = torch.randn(2, 9, 72)
    with torch.inference_mode():
        expected = block[0](x)
    report = swap_fast_layers(block, CPU, torch.float32)
    assert isinstance(block[0], NativeLinear) and isinstance(block[1], PackedLinear)
    assert (report.native_heads, report.packed_linears) == (1, 1)
    with torch.inference_mode():
        torch.testing.assert_close(block[0](x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(block[0](x[:, :1]), expected[:, :1], rtol=1e-5, atol=1e-5)  # one row
    kept = nn.Sequential(nn.Linear(72, 310))
    assert swap_fast_layers(kept, CPU, torch.float32, native_heads=False).native_heads == 0
    assert isinstance(kept[0], PackedLinear)  # compiled steps and TGI_PAGED_NATIVE_LAYERS=0 keep oneDNN
    bf16 = nn.Sequential(nn.Linear(72, 310).to(torch.bfloat16))
    assert swap_fast_layers(bf16, CPU, torch.bfloat16).native_heads == 0  # fp32 only


@pytest.mark.parametrize("bias", [True, False])
def test_bf16_linears_run_the_native_gemm_where_onednn_has_no_bf16(monkeypatch, bias) -> None:
    """AVX2-only CPUs (simulated: oneDNN can pack fp32 only): every plain bf16 linear, of any width, runs the native
    bf16 GEMM (torch's bf16 linear there took 2-7x the fp32 time), with fp32 sums rounded once as torch's does."""
    from tgi_paged_backend.runner.cpu.fast_layers import NativeLinear
    from tgi_paged_kernels import native_kernels

    if native_kernels() is None:
        pytest.skip("native kernels not built here")
    monkeypatch.setattr(fast_layers, "can_pack", lambda dtype, device: dtype == torch.float32)
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(72, 310, bias=bias), nn.Linear(310, 40, bias=bias)).to(torch.bfloat16)
    x = torch.randn(2, 9, 72).bfloat16()
    with torch.inference_mode():
        expected = block(x).float()
    report = swap_fast_layers(block, CPU, torch.bfloat16)
    assert all(isinstance(m, NativeLinear) for m in block)
    assert (report.native_bf16, report.native_heads, report.packed_linears) == (2, 0, 0)
    with torch.inference_mode():
        got = block(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2**-6, atol=2e-2)
    kept = nn.Sequential(nn.Linear(72, 310).to(torch.bfloat16))
    assert swap_fast_layers(kept, CPU, torch.bfloat16, native_heads=False).native_bf16 == 0  # a compiled step
