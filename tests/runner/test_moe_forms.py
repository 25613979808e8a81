"""MoE blocks read for the native decode step (``runner.cpu.moe_forms``): the router's renormalization found by
running it, blocks of another form refused with the reason, and the experts on the packed weights against
transformers' experts module."""

from __future__ import annotations

import pytest
import torch
import transformers

from tgi_paged_backend.runner.cpu.fused_blocks import FusedGatedMLP
from tgi_paged_backend.runner.cpu.moe_forms import NativeExperts, moe_parts
from tgi_paged_kernels.cpu_layer import pack_weight
from tgi_paged_kernels.cpu_native import native_kernels

_SMALL = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def _qwen3_moe_block(norm_topk_prob: bool):
    config = transformers.Qwen3MoeConfig(
        **_SMALL, moe_intermediate_size=48, num_experts=6, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob
    )
    torch.manual_seed(0)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_router_renormalization_is_found_by_running_it(norm_topk_prob) -> None:
    parts = moe_parts(_qwen3_moe_block(norm_topk_prob))
    assert not isinstance(parts, str)
    assert parts.norm_top_k is norm_topk_prob and parts.top_k == 3 and parts.gate_up.shape == (6, 96, 32)


def test_mixtral_always_renormalizes() -> None:
    config = transformers.MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    torch.nn.init.normal_(block.gate.weight, std=0.3)
    parts = moe_parts(block)
    assert not isinstance(parts, str) and parts.norm_top_k


def test_a_shared_expert_is_read_once_fused() -> None:
    """Qwen2-MoE's shared expert: read from its fused form (one gate/up GEMM), else the block keeps the per-op path."""
    config = transformers.Qwen2MoeConfig(
        **_SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=40
    )
    block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
    reason = moe_parts(block)  # its shared expert not fused yet
    assert isinstance(reason, str) and "shared expert" in reason
    block.shared_expert = FusedGatedMLP(block.shared_expert)
    parts = moe_parts(block)
    assert not isinstance(parts, str) and parts.shared is not None
    assert [tuple(t.shape) for t in parts.shared[:3]] == [(80, 32), (32, 40), (1, 32)]


def _native_experts(block) -> NativeExperts:  # noqa: ANN001
    """:class:`NativeExperts` on the packed weights of a :func:`_qwen3_moe_block` (6 experts, 48 wide)."""
    parts = moe_parts(block)
    assert not isinstance(parts, str)
    return NativeExperts(
        torch.cat([pack_weight(w) for w in parts.gate_up]), torch.cat([pack_weight(w) for w in parts.down]),
        6, 48, parts.act_fn, native_kernels(),
    )  # fmt: skip


@pytest.mark.skipif(native_kernels() is None, reason="no C++ compiler here: no native kernels")
def test_native_experts_give_transformers_experts_output() -> None:
    block = _qwen3_moe_block(False)
    native = _native_experts(block)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _, weights, index = block.gate(x)
        want = block.experts(x, index, weights)
        got = native(x, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(native_kernels() is None, reason="no C++ compiler here: no native kernels")
def test_native_experts_take_no_rows_and_skip_the_expert_count() -> None:
    """No tokens: an empty output (as transformers' loop gives), on the native call and the Python loop alike; a pick
    equal to the expert count is skipped on both."""
    block = _qwen3_moe_block(False)
    native = _native_experts(block)
    no_picks = torch.zeros(0, 3, dtype=torch.int64)
    assert native(torch.zeros(0, 32), no_picks, torch.zeros(0, 3)).shape == (0, 32)
    assert native(torch.zeros(0, 32, dtype=torch.float64), no_picks, torch.zeros(0, 3)).shape == (0, 32)
    x, index, weights = torch.randn(2, 32), torch.tensor([[0, 6, 2], [6, 1, 5]]), torch.rand(2, 3)
    with torch.inference_mode():
        want = block.experts(x, index, weights)
        got = native(x, index, weights)
        looped = native(x.double(), index, weights.double()).float()  # not fp32: the Python loop
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(looped, want, rtol=1e-5, atol=1e-5)
