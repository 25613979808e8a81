"""An MoE block's experts in one native call (``cpu_gemm.moe_experts``, ``csrc/cpu_moe.h`` ``run_experts``), given
the router's picks, against the torch reference ``cpu_layer_ref.moe_experts_ref`` (transformers' experts loop):
fp32 and bf16 packings, experts that take no row, a single row; picks outside the experts refused.

Tolerances: fp32 weights, the reference sums in float64 and the kernel in fp32 (1e-5, the fp32 GEMM's); bf16
weights, the reference rounds them (and the activations where the build's bf16 GEMM rounds them) and the kernel
sums in another order, with SiLU between the two GEMMs (1e-4).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tgi_paged_kernels import cpu_native
from tgi_paged_kernels.cpu_gemm import moe_experts, pack_weight, pack_weight_bf16
from tgi_paged_kernels.cpu_layer_ref import gemm_packed_bf16_ref, gemm_packed_ref, moe_experts_ref


@pytest.fixture(scope="module")
def native() -> cpu_native.NativeKernels:
    kernels = cpu_native.native_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here: no native kernels")
    return kernels


def _experts(experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3
    return gate_up, torch.randn(experts, hidden, inter, generator=g) * 0.3


def _packed(
    gate_up: torch.Tensor, down: torch.Tensor, pack: Callable[[torch.Tensor], torch.Tensor] = pack_weight
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's weights packed, stacked (as the native layer holds them)."""
    return torch.cat([pack(w) for w in gate_up]), torch.cat([pack(w) for w in down])


def _picks(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return index, torch.rand(tokens, top_k, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [(1, 32, 48, 4, 2), (9, 37, 40, 6, 3), (40, 64, 24, 8, 1)],  # experts without a row; odd H; many rows
)
def test_experts_match_the_reference(native, dtype, tokens, hidden, inter, experts, top_k) -> None:
    gate_up, down = _experts(experts, hidden, inter, tokens)
    index, weights = _picks(tokens, experts, top_k, tokens + 1)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens + 2))
    pack = pack_weight if dtype == torch.float32 else pack_weight_bf16
    got = moe_experts(native, x, index, weights, *_packed(gate_up, down, pack), inter)
    if dtype == torch.float32:
        want = moe_experts_ref(x, index, weights, gate_up, down)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        rounds = native.gemm_bf16_rounds_activations

        def project(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return gemm_packed_bf16_ref(a, w, rounds_activations=rounds)

        want = moe_experts_ref(x, index, weights, gate_up, down, F.silu, project)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_reference_is_transformers_loop() -> None:
    gate_up, down = _experts(4, 16, 8, 0)
    index, weights = _picks(5, 4, 2, 1)
    x = torch.randn(5, 16)
    want = torch.zeros_like(x)
    for t in range(5):
        for k in range(2):
            gate, up = (x[t].double() @ gate_up[index[t, k]].double().T).chunk(2)
            want[t] += (weights[t, k] * (F.silu(gate) * up) @ down[index[t, k]].double().T).float()
    torch.testing.assert_close(moe_experts_ref(x, index, weights, gate_up, down, project=gemm_packed_ref), want)


def test_a_pick_of_the_expert_count_is_no_expert(native) -> None:
    """transformers' experts skip a pick equal to their count (expert parallelism's mark for an expert held
    elsewhere); so does the kernel, even twice for one token."""
    gate_up, down = _experts(4, 16, 8, 0)
    packed = _packed(gate_up, down)
    x = torch.randn(3, 16)
    index, weights = torch.tensor([[1, 4], [4, 4], [0, 2]]), torch.rand(3, 2)
    got = moe_experts(native, x, index, weights, *packed, 8)
    torch.testing.assert_close(got, moe_experts_ref(x, index, weights, gate_up, down), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], torch.zeros(16))


@pytest.mark.parametrize("bad", [[[0, 5]], [[-1, 0]], [[2, 2]]], ids=["past-the-experts", "negative", "twice"])
def test_bad_picks_are_refused(native, bad) -> None:
    gate_up, down = _experts(4, 16, 8, 0)
    packed = _packed(gate_up, down)
    with pytest.raises(ValueError, match="outside the 4 experts"):
        moe_experts(native, torch.randn(1, 16), torch.tensor(bad), torch.ones(1, 2), *packed, 8)


def test_inputs_that_do_not_fit_are_refused(native) -> None:
    gate_up, down = _experts(4, 16, 8, 0)
    packed = _packed(gate_up, down)
    index, weights = _picks(3, 4, 2, 1)
    with pytest.raises(ValueError, match="do not fit"):
        moe_experts(native, torch.randn(3, 16, dtype=torch.bfloat16), index, weights, *packed, 8)
    with pytest.raises(ValueError, match="do not fit"):
        moe_experts(native, torch.randn(3, 16), index.int(), weights, *packed, 8)
    with pytest.raises(ValueError, match="do not fit"):
        moe_experts(native, torch.randn(3, 17), index, weights, *packed, 8)
