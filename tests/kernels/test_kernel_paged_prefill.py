"""Triton paged prefill/extend attention against the fp32 reference, under TRITON_INTERPRET=1.

Requests in one call mix every prefill flavour, as (query tokens, tokens in the pool):
a one-token prompt, a fresh odd-length prompt, an extend step over a long cached prefix, a request
with no queries this step, and a chunk over an earlier chunk.
"""

from __future__ import annotations

import pytest
import torch

from tgi_paged_kernels.paged_decode import _launch_paged_decode
from tgi_paged_kernels.paged_prefill import _launch_paged_prefill
from tgi_paged_kernels.reference import paged_prefill_attention_reference
from tgi_paged_kernels.testing import assert_attention_close, make_paged_kv, query_start_loc

MIXED_REQUESTS = [(1, 1), (17, 17), (5, 97), (0, 9), (40, 57)]
BLOCK_SIZES = [1, 2, 4, 8, 16, 32]  # 1: token-granular pages (stock TGI's flashinfer layout)


def run_case(
    requests=MIXED_REQUESTS,
    *,
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=64,
    block_size=16,
    q_dtype=torch.float16,
    kv_dtype=None,
    softcap=0.0,
    sliding_window=None,
    k_scale=1.0,
    v_scale=1.0,
    interleaved=False,
    sinks=None,
):
    query_lens, seq_lens = zip(*requests)
    kv = make_paged_kv(
        list(seq_lens), num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        kv_dtype=kv_dtype or q_dtype, k_scale=k_scale, v_scale=v_scale, interleaved=interleaved,
    )  # fmt: skip
    starts = query_start_loc(list(query_lens))
    query = torch.randn(sum(query_lens), num_q_heads, head_dim).to(q_dtype)
    kwargs = dict(
        scale=head_dim**-0.5,
        softcap=softcap,
        sliding_window=sliding_window,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
    )
    out = _launch_paged_prefill(query, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, **kwargs)
    expected = paged_prefill_attention_reference(
        query, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, **kwargs
    )
    assert out.dtype == q_dtype and out.shape == query.shape
    assert_attention_close(out, expected, q_dtype)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mixed_requests_every_block_size(block_size):
    run_case(block_size=block_size)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_every_last_block_fill(block_size):
    # Two new tokens per request, each request's pool ending at a different fill of its last block.
    run_case([(2, fill + block_size * (fill % 2)) for fill in range(1, block_size + 1)], head_dim=16,
             block_size=block_size)  # fmt: skip


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads", [(4, 4), (9, 3), (8, 1), (32, 2)], ids=["mha", "gqa3", "mqa", "gqa16"]
)
def test_gqa_ratios(num_q_heads, num_kv_heads):
    # gqa3: 3 rows per token, so 64-row tiles split a token's heads across two tiles.
    run_case([(5, 17), (30, 97)], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims_and_dtypes(head_dim, q_dtype):
    run_case([(3, 3), (20, 45)], head_dim=head_dim, q_dtype=q_dtype)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache(kv_dtype, q_dtype):
    run_case([(17, 17), (5, 97)], q_dtype=q_dtype, kv_dtype=kv_dtype, k_scale=0.5, v_scale=3.0)


@pytest.mark.parametrize("q_dtype, kv_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float16)])
def test_query_and_cache_dtypes_differ(q_dtype, kv_dtype):
    run_case([(17, 17), (5, 97)], q_dtype=q_dtype, kv_dtype=kv_dtype)


@pytest.mark.parametrize(
    "softcap, sliding_window",
    [(30.0, None), (2.0, None), (0.0, 1), (0.0, 20), (0.0, 500), (5.0, 33)],
    ids=["softcap30", "softcap2", "window1", "window20", "window-wider-than-context", "softcap5-window33"],
)
def test_softcap_and_sliding_window(softcap, sliding_window):
    run_case(softcap=softcap, sliding_window=sliding_window)


@pytest.mark.parametrize("block_size", [1, 2])
def test_small_blocks_with_gqa_window_softcap_fp8_and_interleaved_pool(block_size):
    # Cached prefixes (5 new over 97, 40 over 57) read through one block-table entry per key.
    run_case(
        num_q_heads=9,
        num_kv_heads=3,
        block_size=block_size,
        kv_dtype=torch.float8_e5m2,
        softcap=5.0,
        sliding_window=33,
        k_scale=0.5,
        v_scale=3.0,
        interleaved=True,
    )


@pytest.mark.parametrize("sink_values", [[0.5, -1.0, 0.0], [12.0, 9.0, -30.0]], ids=["small", "dominant"])
@pytest.mark.parametrize(
    "sliding_window, block_size", [(None, 16), (8, 16), (8, 1)], ids=["full", "window8", "window8-block1"]
)
def test_attention_sinks(sink_values, sliding_window, block_size):
    # gqa3: a 64-row tile holds 21 tokens x 3 heads plus one, so each row must pick its own head's sink.
    sinks = torch.tensor(sink_values * 3, dtype=torch.float32)
    run_case(
        num_q_heads=9,
        num_kv_heads=3,
        q_dtype=torch.float32,
        block_size=block_size,
        sinks=sinks,
        sliding_window=sliding_window,
    )


def test_strided_inputs_and_out_buffer():
    requests = [(17, 17), (5, 97)]
    kv = make_paged_kv([97, 17][::-1], num_kv_heads=3, head_dim=64, block_size=16, kv_dtype=torch.float16,
                       interleaved=True)  # fmt: skip
    starts = query_start_loc([n for n, _ in requests])
    qkv = torch.randn(22, 9 + 3 + 3, 64).half()
    query = qkv[:, :9]
    out = torch.full((22, 9, 64), float("nan"))
    result = _launch_paged_prefill(query, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, scale=0.125,
                                   out=out)  # fmt: skip
    assert result is out
    expected = paged_prefill_attention_reference(
        query, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, scale=0.125
    )
    assert_attention_close(out, expected, torch.float16)


@pytest.mark.parametrize("block_size", [1, 16])
def test_one_query_per_request_matches_decode(block_size):
    # Layered check: prefill with q_len = 1 everywhere is decode.
    kv = make_paged_kv([1, 17, 97], num_kv_heads=3, head_dim=64, block_size=block_size, kv_dtype=torch.float32)
    query = torch.randn(3, 9, 64)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables)
    prefill = _launch_paged_prefill(*args, query_start_loc([1, 1, 1]), kv.seq_lens, scale=0.125, sliding_window=20)
    decode = _launch_paged_decode(*args, kv.seq_lens, scale=0.125, sliding_window=20)
    torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-6)  # same fp32 math, other tiling


def test_rejects_bad_arguments():
    kv = make_paged_kv([5, 5], num_kv_heads=1, head_dim=64, block_size=16, kv_dtype=torch.float16)
    query = torch.randn(4, 2, 64).half()
    with pytest.raises(ValueError, match="query_start_loc"):
        _launch_paged_prefill(query, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc([2]), kv.seq_lens,
                              scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="block_tables"):
        _launch_paged_prefill(query, kv.k_cache, kv.v_cache, kv.block_tables[:1], query_start_loc([2, 2]),
                              kv.seq_lens, scale=1.0)  # fmt: skip
