"""The native prefill attention (``tgi_paged_kernels.cpu_prefill``) against the per-request reference: fresh
prompts, chunks over a cached prefix, windows, soft-cap, sinks, bf16/fp8 pools; the public CPU path takes it;
bad lengths and tables are refused."""

from __future__ import annotations

import pytest
import torch

from tgi_paged_kernels import paged_prefill_attention
from tgi_paged_kernels.cpu_prefill import prefill_attention
from tgi_paged_kernels.reference import paged_prefill_attention_reference
from tgi_paged_kernels.testing import assert_attention_close, make_paged_kv, query_start_loc

CASES = [
    # (num_q_heads, num_kv_heads, head_dim, block_size, kv dtype, softcap, window, sinks)
    (2, 1, 64, 16, torch.float32, 0.0, None, False),  # the host-bound model's geometry
    (9, 3, 64, 16, torch.float32, 0.0, None, False),  # SmolLM2's
    (4, 2, 24, 4, torch.float32, 0.0, 9, False),  # a window, a head_dim not a multiple of 16
    (4, 2, 128, 8, torch.float32, 30.0, 5, True),  # soft-cap, window and sinks
    (4, 4, 32, 1, torch.bfloat16, 0.0, None, False),  # one token per block, a bf16 pool
    (4, 2, 16, 4, torch.float8_e4m3fn, 0.0, None, True),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}q{c[1]}kv{c[2]}d-bs{c[3]}-{c[4]}-cap{c[5]}-w{c[6]}-s{c[7]}"
)
@pytest.mark.parametrize("interleaved", [False, True], ids=["split-pools", "one-pool"])
def test_prefill_matches_the_reference(native, case, interleaved) -> None:
    """Fresh prompts (q_len == seq_len), chunks over a cached prefix, a one-token chunk and an empty request."""
    num_q_heads, num_kv_heads, head_dim, block_size, kv_dtype, softcap, window, use_sinks = case
    generator = torch.Generator().manual_seed(0)
    seq_lens = [5, 40, 33, 1, 20, 7, 60]
    q_lens = [5, 12, 33, 1, 1, 0, 37]
    kv = make_paged_kv(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, kv_dtype=kv_dtype,
        k_scale=0.5, v_scale=1.5, interleaved=interleaved, generator=generator,
    )  # fmt: skip
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=generator)
    sinks = torch.randn(num_q_heads, generator=generator) * 2 if use_sinks else None
    options = dict(scale=head_dim**-0.5, softcap=softcap, sliding_window=window, k_scale=0.5, v_scale=1.5, sinks=sinks)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc(q_lens), kv.seq_lens)
    expected = paged_prefill_attention_reference(*args, **options)
    got = prefill_attention(native, *args, **options)
    assert got is not None and torch.isfinite(got).all()
    assert_attention_close(got, expected, torch.float32)
    assert_attention_close(paged_prefill_attention(*args, **options), expected, torch.float32)  # the public path


def test_prefill_reads_strided_queries_and_int64_indices(native) -> None:
    kv = make_paged_kv([9, 30], num_kv_heads=2, head_dim=16, block_size=4, kv_dtype=torch.float32)
    hf_layout = torch.randn(1, 4, 21, 16)
    view = hf_layout[0].transpose(0, 1)  # what the attention hook passes: a view of HF's [1, Hq, T, D]
    starts = query_start_loc([9, 12])
    expected = paged_prefill_attention_reference(view.contiguous(), kv.k_cache, kv.v_cache, kv.block_tables, starts,
                                                 kv.seq_lens, scale=0.25)  # fmt: skip
    got = prefill_attention(native, view, kv.k_cache, kv.v_cache, kv.block_tables.long(), starts.long(),
                            kv.seq_lens.long(), scale=0.25, softcap=0.0, sliding_window=None, sinks=None,
                            k_scale=1.0, v_scale=1.0)  # fmt: skip
    assert got is not None
    assert_attention_close(got, expected, torch.float32)
    options = dict(scale=0.25, softcap=0.0, sliding_window=None, sinks=None, k_scale=1.0, v_scale=1.0)
    bf16 = prefill_attention(native, view.bfloat16(), kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens,
                             **options)  # fmt: skip
    assert bf16 is None  # the torch path serves bf16 queries


def test_bad_lengths_and_tables_raise(native) -> None:
    kv = make_paged_kv([5, 20], num_kv_heads=1, head_dim=16, block_size=8, kv_dtype=torch.float32)
    query = torch.randn(10, 1, 16)
    options = dict(scale=1.0, softcap=0.0, sliding_window=None, sinks=None, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="query_start_loc"):  # 7 queries for a request of 5 tokens
        prefill_attention(native, query, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc([7, 3]),
                          kv.seq_lens, **options)  # fmt: skip
    with pytest.raises(ValueError, match="query_start_loc must rise"):  # ends right, falls in the middle
        prefill_attention(native, query, kv.k_cache, kv.v_cache, kv.block_tables,
                          torch.tensor([0, 12, 10], dtype=torch.int32), kv.seq_lens, **options)  # fmt: skip
    with pytest.raises(ValueError, match="need 5 blocks"):
        prefill_attention(native, query, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc([5, 5]),
                          torch.tensor([5, 40], dtype=torch.int32), **options)  # fmt: skip
    outside = kv.block_tables.clone()
    outside[1, 1] = kv.k_cache.shape[0]
    with pytest.raises(ValueError, match="block id outside the pool's"):
        prefill_attention(native, query, kv.k_cache, kv.v_cache, outside, query_start_loc([5, 5]), kv.seq_lens,
                          **options)  # fmt: skip


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("window,limits", [(None, False), (23, False), (None, True)], ids=["causal", "window", "spans"])
def test_one_long_prompt_is_cut_into_row_ranges_across_threads(native, threads, window, limits) -> None:
    """One request with one KV head has fewer (request, KV head) pairs than threads: the kernel cuts its query
    rows into ranges (each packing only the keys its rows see); the result is the reference's either way."""
    generator = torch.Generator().manual_seed(3)
    seq_lens, q_lens = [150], [131]  # a chunk over a 19-token cached prefix
    kv = make_paged_kv(seq_lens, num_kv_heads=1, head_dim=32, block_size=16, kv_dtype=torch.float32,
                       generator=generator)  # fmt: skip
    query = torch.randn(sum(q_lens), 3, 32, generator=generator)
    attend = None
    if limits:  # rows 40..79 see each other both ways (a bidirectional span), the rest causal
        positions = torch.arange(19, 150)
        attend = torch.where((positions >= 59) & (positions < 99), torch.tensor(98), positions)
    options = dict(scale=32**-0.5, softcap=0.0, sliding_window=window, k_scale=1.0, v_scale=1.0, sinks=None)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc(q_lens), kv.seq_lens)
    expected = paged_prefill_attention_reference(*args, **options, attend_limits=attend)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = prefill_attention(native, *args, **options, attend_limits=attend)
    finally:
        torch.set_num_threads(previous)
    assert got is not None
    assert_attention_close(got, expected, torch.float32)
