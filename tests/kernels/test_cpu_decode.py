"""The no-gather CPU decode kernel (``tgi_paged_kernels.cpu_decode``): compiled by inductor and eager,
against the reference and the gather + SDPA path, over the adversarial axes (NaN-poisoned unowned
slots, GQA/MQA, soft-capping, windows, sinks, fp8/bf16 pools); one compiled graph for many batch
sizes and context lengths; and the fallback when compilation fails."""

from __future__ import annotations

import pytest
import torch

from tgi_paged_kernels import paged_decode_attention
from tgi_paged_kernels.cpu_decode import CompiledDecode, compiled_decode_attention, decode_attention_math
from tgi_paged_kernels.reference import paged_decode_attention_reference
from tgi_paged_kernels.testing import assert_attention_close, make_paged_kv

CASES = [
    # (num_q_heads, num_kv_heads, head_dim, block_size, kv dtype, softcap, window, sinks)
    (9, 3, 64, 16, torch.float32, 0.0, None, False),  # SmolLM2's geometry
    (4, 1, 16, 4, torch.float32, 0.0, None, False),  # MQA
    (4, 2, 16, 4, torch.float32, 30.0, 5, False),  # Gemma 2: soft-cap and a window
    (4, 2, 16, 8, torch.float32, 0.0, 6, True),  # gpt-oss: sinks and a window
    (4, 2, 16, 4, torch.float8_e4m3fn, 0.0, None, False),
    (4, 4, 16, 1, torch.bfloat16, 0.0, None, False),  # one token per block
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}q{c[1]}kv{c[2]}d-bs{c[3]}-{c[4]}-cap{c[5]}-w{c[6]}-s{c[7]}"
)
@pytest.mark.parametrize("cpu_kernel", ["native", "compiled", "sdpa"])
def test_decode_paths_match_the_reference(case, cpu_kernel):
    num_q_heads, num_kv_heads, head_dim, block_size, kv_dtype, softcap, window, use_sinks = case
    generator = torch.Generator().manual_seed(0)
    seq_lens = [1, 7, 13, 29, 3]
    kv = make_paged_kv(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, kv_dtype=kv_dtype,
        k_scale=0.5, v_scale=1.5, generator=generator,
    )  # fmt: skip
    query = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=generator)
    sinks = torch.randn(num_q_heads, generator=generator) * 2 if use_sinks else None
    options = dict(scale=head_dim**-0.5, softcap=softcap, sliding_window=window, k_scale=0.5, v_scale=1.5, sinks=sinks)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    expected = paged_decode_attention_reference(*args, **options)
    assert_attention_close(paged_decode_attention(*args, cpu_kernel=cpu_kernel, **options), expected, torch.float32)


def test_eager_math_reads_only_owned_slots():
    """The reference form itself (uncompiled): NaN everywhere outside the requests' positions stays out."""
    kv = make_paged_kv([5, 17], num_kv_heads=2, head_dim=8, block_size=4, kv_dtype=torch.float32)
    query = torch.randn(2, 4, 8)
    table = kv.block_tables.long()
    got = decode_attention_math(query, kv.k_cache, kv.v_cache, table, kv.seq_lens, 0.3, 0.0, None, None, 1.0, 1.0)
    expected = paged_decode_attention_reference(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale=0.3)
    assert torch.isfinite(got).all()
    assert_attention_close(got, expected, torch.float32)


def test_strided_query_views_are_read_as_they_are():
    """The attention hook passes ``query[0].transpose(0, 1)`` (a view of HF's [1, Hq, T, D]) without a copy."""
    kv = make_paged_kv([9, 4, 21], num_kv_heads=2, head_dim=16, block_size=4, kv_dtype=torch.float32)
    hf_layout = torch.randn(1, 4, 3, 16)
    view = hf_layout[0].transpose(0, 1)
    assert not view.is_contiguous()
    args = (kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    got = paged_decode_attention(view, *args, scale=0.25)
    expected = paged_decode_attention_reference(view.contiguous(), *args, scale=0.25)
    assert_attention_close(got, expected, torch.float32)


def test_one_graph_serves_every_batch_size_context_length_and_pool_size():
    """Dynamic batch, block-table width and pool size (batch and width 1 padded to 2): one graph, plus at
    most one more when two sizes first coincide (dynamo's duck sizing guards their equality)."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    kernel = CompiledDecode(backend=counting_backend)
    for batch, length in [(3, 9), (5, 30), (1, 3), (8, 17), (2, 64), (1, 41), (7, 5)]:
        kv = make_paged_kv([length] * batch, num_kv_heads=2, head_dim=8, block_size=4, kv_dtype=torch.float32)
        query = torch.randn(batch, 4, 8)
        table = kv.block_tables.long()
        got = kernel(query, kv.k_cache, kv.v_cache, table, kv.seq_lens, 0.3, 0.0, None, None, 1.0, 1.0)
        expected = paged_decode_attention_reference(
            query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale=0.3
        )
        assert_attention_close(got, expected, torch.float32)
    assert kernel.failed is None
    assert len(graphs) <= 2


def test_a_failed_compile_falls_back_to_gather_sdpa_for_good(monkeypatch):
    broken = CompiledDecode()
    calls = []

    def fail(*args):
        calls.append(1)
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr(broken, "_fn", fail)
    monkeypatch.setattr("tgi_paged_kernels.torch_impl.compiled_decode_attention", lambda: broken)
    kv = make_paged_kv([6, 11], num_kv_heads=2, head_dim=8, block_size=4, kv_dtype=torch.float32)
    query = torch.randn(2, 4, 8)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    expected = paged_decode_attention_reference(*args, scale=0.3)
    for _ in range(2):
        got = paged_decode_attention(*args, scale=0.3, cpu_kernel="compiled")
        assert_attention_close(got, expected, torch.float32)
    assert broken.failed == "RuntimeError: no C++ compiler"
    assert calls == [1]  # tried once, then the gather path serves without retrying


def test_the_process_shares_one_compiled_kernel():
    assert compiled_decode_attention() is compiled_decode_attention()
