"""Triton paged decode (single pass and split-K) against the fp32 reference, under TRITON_INTERPRET=1.

Every case is built by ``make_paged_kv``: shuffled physical blocks, NaN in every slot no request
owns and in the block-table padding, so reading one slot too many fails the comparison. The grid
is chosen to cover each axis at least once with split-K both off and on, at tiny shapes: the
interpreter runs each program in Python.
"""

from __future__ import annotations

import pytest
import torch

from tgi_paged_kernels import paged_decode
from tgi_paged_kernels.paged_decode import MAX_SPLITS, MIN_TOKENS_PER_SPLIT, _launch_paged_decode, choose_num_splits
from tgi_paged_kernels.reference import paged_decode_attention_reference
from tgi_paged_kernels.testing import assert_attention_close, make_paged_kv

ODD_LENGTHS = [1, 17, 97]
BLOCK_SIZES = [1, 2, 4, 8, 16, 32]  # 1: token-granular pages (stock TGI's flashinfer layout)
SPLITS = [1, 3]  # 1: single pass. 3: split-K; with 64-token slices a 97-token request leaves slice 3 empty.


def run_case(
    seq_lens,
    *,
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=64,
    block_size=16,
    q_dtype=torch.float16,
    kv_dtype=None,
    num_splits=1,
    softcap=0.0,
    sliding_window=None,
    k_scale=1.0,
    v_scale=1.0,
    interleaved=False,
    sinks=None,
):
    kv = make_paged_kv(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        kv_dtype=kv_dtype or q_dtype, k_scale=k_scale, v_scale=v_scale, interleaved=interleaved,
    )  # fmt: skip
    query = torch.randn(len(seq_lens), num_q_heads, head_dim).to(q_dtype)
    kwargs = dict(
        scale=head_dim**-0.5,
        softcap=softcap,
        sliding_window=sliding_window,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
    )
    out = _launch_paged_decode(
        query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, num_splits=num_splits, **kwargs
    )
    expected = paged_decode_attention_reference(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, **kwargs)
    assert out.dtype == q_dtype and out.shape == query.shape
    assert_attention_close(out, expected, q_dtype)


@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_odd_lengths_every_block_size(block_size, num_splits):
    run_case(ODD_LENGTHS, block_size=block_size, num_splits=num_splits)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_every_last_block_fill(block_size):
    # One request per fill level 1..block_size of its last block, spread over 1-3 blocks.
    seq_lens = [fill + block_size * (fill % 3) for fill in range(1, block_size + 1)]
    run_case(seq_lens, head_dim=16, block_size=block_size)


@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, num_splits",
    [(4, 4, 1), (9, 3, 1), (9, 3, 3), (8, 1, 1), (8, 1, 3), (32, 2, 1)],
    ids=["mha", "gqa3", "gqa3-split", "mqa", "mqa-split", "gqa16"],
)
def test_gqa_ratios(num_q_heads, num_kv_heads, num_splits):
    run_case([17, 97], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, num_splits=num_splits)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims_and_dtypes(head_dim, q_dtype):
    # Non-powers of two (80, 96) exercise the padded, masked head_dim axis; split-K alternates.
    run_case([5, 70], head_dim=head_dim, q_dtype=q_dtype, num_splits=1 + head_dim % 3)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache(kv_dtype, q_dtype):
    # Distinct K and V scales catch one being applied in the other's place; split-K with fp16 queries.
    num_splits = 3 if q_dtype == torch.float16 else 1
    run_case(ODD_LENGTHS, q_dtype=q_dtype, kv_dtype=kv_dtype, num_splits=num_splits, k_scale=0.5, v_scale=3.0)


@pytest.mark.parametrize(
    "q_dtype, kv_dtype",
    [(torch.float16, torch.float32), (torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16)],
)
def test_query_and_cache_dtypes_differ(q_dtype, kv_dtype):
    run_case(ODD_LENGTHS, q_dtype=q_dtype, kv_dtype=kv_dtype, num_splits=2)


@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize(
    "softcap, sliding_window",
    [(30.0, None), (2.0, None), (0.0, 1), (0.0, 20), (0.0, 500), (5.0, 33)],
    ids=["softcap30", "softcap2", "window1", "window20", "window-wider-than-context", "softcap5-window33"],
)
def test_softcap_and_sliding_window(softcap, sliding_window, num_splits):
    run_case(ODD_LENGTHS, softcap=softcap, sliding_window=sliding_window, num_splits=num_splits)


SINK_CASES = dict(small=[0.5, -1.0, 0.0], dominant=[12.0, 9.0, -30.0])  # dominant: the sink takes ~all mass


@pytest.mark.parametrize("num_splits", [1, 3, 7])  # 7 slices of the 97-token request: most are empty
@pytest.mark.parametrize("sink_values", list(SINK_CASES.values()), ids=list(SINK_CASES))
@pytest.mark.parametrize("sliding_window", [None, 8], ids=["full", "window8"])
def test_attention_sinks(sink_values, sliding_window, num_splits):
    # gpt-oss: one logit per query head joins the softmax denominator, in the single pass's epilogue
    # or once in the split-K reduction. 9 query heads over 3 KV heads: each group's rows get their own.
    sinks = torch.tensor(sink_values * 3, dtype=torch.float32)
    run_case(ODD_LENGTHS, num_q_heads=9, num_kv_heads=3, q_dtype=torch.float32, sinks=sinks,
             sliding_window=sliding_window, num_splits=num_splits)  # fmt: skip


def test_attention_sinks_change_the_output():
    # The option is not a no-op: without the sinks the same case is far from the reference with them.
    kv = make_paged_kv([17], num_kv_heads=1, head_dim=16, block_size=4, kv_dtype=torch.float32)
    query, sinks = torch.randn(1, 2, 16), torch.tensor([3.0, 3.0])
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    with_sinks = paged_decode_attention_reference(*args, scale=0.25, sinks=sinks)
    plain = _launch_paged_decode(*args, scale=0.25)
    assert (with_sinks - plain).abs().max() > 0.1


@pytest.mark.parametrize("num_splits", SPLITS)
def test_strided_inputs_and_out_buffer(num_splits):
    # K/V interleaved in one [num_blocks, 2, ...] pool; the query a slice of a fused QKV row; out=.
    kv = make_paged_kv(ODD_LENGTHS, num_kv_heads=3, head_dim=64, block_size=16, kv_dtype=torch.float16,
                       interleaved=True)  # fmt: skip
    qkv = torch.randn(3, 9 + 3 + 3, 64).half()
    query = qkv[:, :9]
    out = torch.full((3, 9, 64), float("nan"), dtype=torch.float32)
    result = _launch_paged_decode(
        query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale=0.125, out=out, num_splits=num_splits
    )
    assert result is out
    expected = paged_decode_attention_reference(
        query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale=0.125
    )
    assert_attention_close(out, expected, torch.float16)


@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("block_size", [1, 2])
def test_small_blocks_with_gqa_window_softcap_fp8_and_interleaved_pool(block_size, num_splits):
    # Tiles of 64 keys span 32-64 physical blocks here: every key is its own block-table lookup.
    run_case(ODD_LENGTHS, num_q_heads=9, num_kv_heads=3, block_size=block_size, kv_dtype=torch.float8_e4m3fn,
             num_splits=num_splits, softcap=5.0, sliding_window=33, k_scale=0.5, v_scale=3.0,
             interleaved=True)  # fmt: skip


def test_many_splits_agree_with_single_pass():
    # More slices than a request has tiles: most slices are empty and must weigh nothing.
    run_case([1, 200], head_dim=16, block_size=8, q_dtype=torch.float32, num_splits=7)


def test_automatic_split_choice_on_a_large_device(monkeypatch):
    # Pretend to be a 132-SM GPU: 2 requests x 1 KV head is far too few programs, so the launcher
    # splits, here into 4 slices of 256 tokens (the table's 63 + 1 padding blocks allow 1024 tokens).
    monkeypatch.setattr(paged_decode, "_num_sms", lambda device: 132)
    calls = []
    monkeypatch.setattr(paged_decode, "choose_num_splits", lambda *a: calls.append(a) or choose_num_splits(*a))
    run_case([600, 1000], head_dim=16, q_dtype=torch.float32, num_splits=None)
    assert calls == [(2, 64 * 16, 132)]


def test_choose_num_splits():
    # Few programs, long context: split to fill about two programs per SM.
    assert choose_num_splits(num_programs=8, max_context=32768, num_sms=132) == 33
    # Enough programs already: single pass.
    assert choose_num_splits(num_programs=2048, max_context=32768, num_sms=132) == 1
    # Short context: never slices under MIN_TOKENS_PER_SPLIT tokens.
    assert choose_num_splits(num_programs=1, max_context=3 * MIN_TOKENS_PER_SPLIT, num_sms=132) == 3
    assert choose_num_splits(num_programs=1, max_context=100, num_sms=132) == 1
    # Capped.
    assert choose_num_splits(num_programs=1, max_context=1 << 20, num_sms=1000) == MAX_SPLITS


def test_rejects_bad_arguments():
    kv = make_paged_kv([5], num_kv_heads=2, head_dim=64, block_size=16, kv_dtype=torch.float16)
    args = (kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _launch_paged_decode(torch.randn(1, 3, 64).half(), *args, scale=1.0)
    with pytest.raises(ValueError, match="query dtype"):
        _launch_paged_decode(torch.randn(1, 4, 64).double(), *args, scale=1.0)
    with pytest.raises(ValueError, match="stride 1"):
        _launch_paged_decode(torch.randn(1, 64, 4).half().transpose(1, 2), *args, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        _launch_paged_decode(torch.randn(1, 4, 64).half(), *args, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="k_scale"):
        _launch_paged_decode(torch.randn(1, 4, 64).half(), *args, scale=1.0, k_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="sinks"):
        _launch_paged_decode(torch.randn(1, 4, 64).half(), *args, scale=1.0, sinks=torch.zeros(2))
