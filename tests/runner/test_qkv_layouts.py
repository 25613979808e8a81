"""The checkpoints' q/k/v layouts read into one all-q, all-k, all-v projection (``runner.cpu.qkv_layouts``): each
against the split the module itself makes (Falcon's three variants, GPT-BigCode with and without multi-query, GPT-2
after its Conv1D is linearized)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

from tgi_paged_backend.runner.cpu.qkv_layouts import linearize_conv1d, qkv_layout
from tgi_paged_backend.runner.families.falcon import PagedFalconAttention, StepChannel


def _split(layout, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hq, hkv, d = layout.num_q_heads, layout.num_kv_heads, layout.head_dim
    out = layout.projection(x).view(x.shape[0], hq + 2 * hkv, d)
    return out[:, :hq], out[:, hq : hq + hkv], out[:, hq + hkv :]


@pytest.mark.parametrize(
    ("variant", "kv_heads"),
    [
        (dict(new_decoder_architecture=True, num_kv_heads=2), 2),  # per KV group: 2 queries, key, value
        (dict(new_decoder_architecture=False, multi_query=True), 1),  # all queries, one key, one value
        (dict(new_decoder_architecture=False, multi_query=False), 4),  # per head: q, k, v
    ],
)
def test_falcon_rows_are_the_heads_its_attention_splits(variant, kv_heads) -> None:
    config = transformers.FalconConfig(hidden_size=64, num_attention_heads=4, bias=True, **variant)
    torch.manual_seed(0)
    original = transformers.models.falcon.modeling_falcon.FalconAttention(config, layer_idx=0)
    attn = PagedFalconAttention(original, config, 0, StepChannel())
    layout = qkv_layout(attn)
    assert layout is not None and (layout.num_q_heads, layout.num_kv_heads, layout.head_dim) == (4, kv_heads, 16)
    assert type(layout.projection) is nn.Linear  # FalconLinear's rows, reordered into a plain linear
    x = torch.randn(5, 64)
    for got, want in zip(_split(layout, x), attn.split_heads(attn.query_key_value(x[None])[0])):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("multi_query", [True, False])
def test_gpt_bigcode_rows_are_the_heads_its_attention_splits(multi_query) -> None:
    config = transformers.GPTBigCodeConfig(n_embd=64, n_head=4, multi_query=multi_query)
    torch.manual_seed(0)
    attn = transformers.models.gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeAttention(config, layer_idx=0)
    layout = qkv_layout(attn)
    assert layout is not None and (layout.num_q_heads, layout.num_kv_heads) == (4, 1 if multi_query else 4)
    x = torch.randn(5, 64)
    fused = attn.c_attn(x)
    if multi_query:  # all queries, then one key and one value head
        want = fused[:, :64].view(5, 4, 16), fused[:, 64:80].view(5, 1, 16), fused[:, 80:].view(5, 1, 16)
        assert layout.projection is attn.c_attn  # taken as it is
    else:  # per head: its q, k, v
        want = tuple(t.contiguous() for t in fused.view(5, 4, 3 * 16).split(16, dim=-1))
    for got, expected in zip(_split(layout, x), want):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_conv1d_becomes_the_linear_of_its_transposed_weight() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(Conv1D(96, 32), nn.ReLU(), Conv1D(32, 96))
    x = torch.randn(3, 32)
    want = block(x)
    assert linearize_conv1d(block) == 2
    assert all(type(block[i]) is nn.Linear for i in (0, 2)) and block[0].weight.shape == (96, 32)
    torch.testing.assert_close(block(x), want, rtol=1e-6, atol=1e-6)
