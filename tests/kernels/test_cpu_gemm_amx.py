"""The bf16 GEMM on AMX tiles (``csrc/cpu_gemm_amx.h``) against its torch reference: activations rounded to bf16
(RNE) times the bf16 weights, summed in fp32, at odd shapes (rows 1..40 around the 16-row tiles, ``K`` not a
multiple of 32 nor even, ``N`` not a multiple of 16); skipped where the host, the build or the OS lends no tiles.

Tolerance, derived: both sides hold the same exact products (a bf16 x bf16 product is exact in fp32); the kernel
sums them in fp32 in the tiles' order, so each output is within ``k * 2^-24 * sum_k |a_k w_k|`` (the classic
bound of a k-term fp32 sum) of the float64 sum of the same products.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_cpu_layer import _step
from tests.kernels.test_cpu_layer_bf16 import BF16_ULP, _bf16_layer
from tgi_paged_kernels.cpu_gemm import gemm_packed, pack_weight, pack_weight_bf16, set_bf16_amx, set_bf16_dot
from tgi_paged_kernels.cpu_layer import decode_layer
from tgi_paged_kernels.cpu_layer_ref import decode_layer_ref


@pytest.fixture
def amx(native):
    """The native kernels with the AMX GEMM on (restored on after the test), or a skip with the reason."""
    if not set_bf16_amx(native, True):
        pytest.skip("no AMX-BF16 here: the CPU lacks amx_bf16, the build lacks -mamx-bf16 or Linux refused the tiles")
    dot = set_bf16_dot(native)
    set_bf16_dot(native, False)  # AMX off means the widening path in these tests
    yield native
    set_bf16_amx(native, True)
    set_bf16_dot(native, dot)


def _operands(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    a64, w64 = x.to(torch.bfloat16).double(), w.to(torch.bfloat16).double()
    exact = a64 @ w64.T
    bound = x.shape[1] * 2.0**-24 * (a64.abs() @ w64.abs().T)
    if b is not None:  # the epilogue adds the bias to the fp32 sum: one more rounding
        exact = exact + b.double()
        bound = bound + 2.0**-24 * exact.abs()
    assert ((got.double() - exact).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize(("k", "n"), [(45, 17), (100, 50), (577, 33), (64, 16)])
def test_amx_gemm_matches_the_reference_at_every_row_count(amx, k, n) -> None:
    for m in range(1, 41):
        x, w, b = _operands(m, k, n, seed=m * k + n)
        bias = b if m % 2 else None
        _check(gemm_packed(amx, x, pack_weight_bf16(w), n, bias), x, w, bias)


def test_amx_gemm_rounds_the_activations(amx) -> None:
    """Activations one bf16 rounding away from a grid value: the AMX GEMM sees the rounded value (as a torch bf16
    model does), the widening path the fp32 one; the switch selects each in one process."""
    k, n = 64, 20
    w = torch.ones(n, k)
    x = torch.full((3, k), 1.0 + 2.0**-10)  # rounds to 1.0 in bf16
    packed = pack_weight_bf16(w)
    assert torch.equal(gemm_packed(amx, x, packed, n), torch.full((3, n), float(k)))
    assert amx.gemm_bf16_rounds_activations
    assert not set_bf16_amx(amx, False) and not amx.gemm_bf16_rounds_activations
    widened = gemm_packed(amx, x, packed, n)
    assert torch.equal(widened, gemm_packed(amx, x, pack_weight(w), n))  # the fp32 GEMM's bits
    assert (widened > k).all()


def test_amx_gemm_rows_do_not_depend_on_their_batch(amx) -> None:
    x, w, _ = _operands(45, 300, 70, seed=3)
    packed = pack_weight_bf16(w)
    whole = gemm_packed(amx, x, packed, 70)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(16, 45), slice(44, 45)):
        assert torch.equal(gemm_packed(amx, x[rows].contiguous(), packed, 70), whole[rows])


def test_amx_gemm_many_rows_and_a_long_k(amx) -> None:
    """Past one task's 128 rows (several row chunks) and with a tail of k pairs after many full tiles."""
    x, w, b = _operands(300, 1100, 90, seed=5)
    _check(gemm_packed(amx, x, pack_weight_bf16(w), 90, b), x, w, b)


def test_the_switch_reaches_the_decode_layer(amx) -> None:
    """One switch for the whole library: the native decode layer's projections follow it (AMX: its reference with
    rounded activations; off: the widening reference), and the two differ."""
    rounded, w, (_, hkv, d, _) = _bf16_layer("Llama")
    (k_pool, v_pool), tables, seq_lens, slots = _step([4, 21, 9], 4, hkv, d, torch.int32)
    x, cs = torch.randn(3, 96).bfloat16(), torch.rand(3, d).bfloat16()
    outs = []
    for on in (True, False):
        assert set_bf16_amx(amx, on) == on
        pools = k_pool.bfloat16(), v_pool.bfloat16()
        ref_pools = k_pool.bfloat16(), v_pool.bfloat16()
        got = decode_layer(amx, w, x, cs, cs, *pools, slots, tables, seq_lens)
        expected = decode_layer_ref(rounded, w, x, cs, cs, *ref_pools, slots, tables, seq_lens, rounds_activations=on)
        assert got is not None
        torch.testing.assert_close(got.float(), expected.float(), rtol=BF16_ULP, atol=1e-4)
        outs.append(got)
    assert not torch.equal(outs[0], outs[1])
