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


BAD_INPUTS = {
    "head_dim": dict(query=(2, 4, 16)),  # the pool's head_dim is 8
    "heads": dict(query=(2, 3, 8)),  # 3 query heads over 2 KV heads
    "sinks": dict(sinks=3),  # one per query head (4)
    "block_id": dict(block_id=99),  # outside the pool
}


def _bad_call(kind):
    kv = make_paged_kv([6, 11], num_kv_heads=2, head_dim=8, block_size=4, kv_dtype=torch.float32)
    bad = BAD_INPUTS[kind]
    table = kv.block_tables.long()
    if "block_id" in bad:
        table[1, 1] = bad["block_id"]
    query = torch.randn(*bad.get("query", (2, 4, 8)))
    sinks = torch.randn(bad["sinks"]) if "sinks" in bad else None
    return (query, kv.k_cache, kv.v_cache, table, kv.seq_lens, 0.3, 0.0, None, sinks, 1.0, 1.0), kv


@pytest.mark.parametrize("kind", list(BAD_INPUTS))
def test_an_input_error_is_raised_as_the_eager_math_raises_it_and_the_kernel_stays_on(kind):
    """Issue 43: any error at call time used to turn the compiled kernel off for the process (and the gather
    path then reported another error). A bad input now raises the eager math's own error, every time."""
    kernel = CompiledDecode(backend="eager")  # dynamo traces as for inductor; no C++ build needed
    args, kv = _bad_call(kind)
    with pytest.raises(Exception) as eager:
        decode_attention_math(*args)
    for _ in range(2):
        with pytest.raises(Exception) as compiled:
            kernel(*args)
        assert type(compiled.value) is type(eager.value) and str(compiled.value) == str(eager.value)
    assert kernel.failed is None
    query = torch.randn(2, 4, 8)  # still on: a good input is served compiled
    got = kernel(query, kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.seq_lens, 0.3, 0.0, None, None, 1.0, 1.0)
    assert got is not None
    expected = paged_decode_attention_reference(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale=0.3)
    assert_attention_close(got, expected, torch.float32)


def test_a_bad_input_gets_one_error_through_the_compiled_path(monkeypatch):
    """A block id outside the pool passes the API's checks: the compiled path raises the eager math's error on
    every call (it used to turn itself off, and the gather path then said "index out of range in self")."""
    kernel = CompiledDecode(backend="eager")
    monkeypatch.setattr("tgi_paged_kernels.torch_impl.compiled_decode_attention", lambda: kernel)
    kv = make_paged_kv([6, 11], num_kv_heads=2, head_dim=8, block_size=4, kv_dtype=torch.float32)
    table = kv.block_tables.clone()
    table[1, 1] = 99
    args = (torch.randn(2, 4, 8), kv.k_cache, kv.v_cache, table, kv.seq_lens)
    for _ in range(2):
        with pytest.raises(IndexError, match="^index 99 is out of bounds for dimension 0 with size 8$"):
            paged_decode_attention(*args, scale=0.3, cpu_kernel="compiled")
    assert kernel.failed is None


def test_a_backend_that_cannot_compile_turns_the_kernel_off(monkeypatch):
    """A real compile failure (the backend raises, dynamo reports BackendCompilerFailed): off for good, without
    running the eager math on the batch (it materialises every request's K/V: Warmup's batch is large)."""
    attempts = []

    def no_compiler(gm, example_inputs):
        attempts.append(1)
        raise RuntimeError("no C++ compiler")

    kernel = CompiledDecode(backend=no_compiler)
    monkeypatch.setattr("tgi_paged_kernels.cpu_decode.decode_attention_math", None)  # the compiled copy is kept
    kv = make_paged_kv([6, 11], num_kv_heads=2, head_dim=8, block_size=4, kv_dtype=torch.float32)
    args = (torch.randn(2, 4, 8), kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.seq_lens)
    assert kernel(*args, 0.3, 0.0, None, None, 1.0, 1.0) is None
    assert kernel.failed is not None and kernel.failed.startswith("BackendCompilerFailed")
    assert kernel(*args, 0.3, 0.0, None, None, 1.0, 1.0) is None and attempts == [1]


def test_the_process_shares_one_compiled_kernel():
    assert compiled_decode_attention() is compiled_decode_attention()
