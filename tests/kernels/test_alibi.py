"""ALiBi (``alibi_slopes``) in the paged attention kernels: the reference against the formula HF Bloom and MPT
use, then the CPU torch paths and the Triton kernels (under ``TRITON_INTERPRET=1``, small shapes) against the
reference. Cases come from ``make_paged_kv``: shuffled blocks, NaN in every slot no request owns."""

from __future__ import annotations

import pytest
import torch

from tgi_paged_kernels import paged_decode_attention, paged_prefill_attention
from tgi_paged_kernels.paged_decode import _launch_paged_decode
from tgi_paged_kernels.paged_prefill import _launch_paged_prefill
from tgi_paged_kernels.reference import (
    attend_one_request,
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
)
from tgi_paged_kernels.testing import assert_attention_close, make_paged_kv, query_start_loc

DECODE_LENGTHS = [1, 17, 97]
PREFILL_REQUESTS = [(5, 5), (1, 33), (7, 40), (16, 16)]  # (new tokens, seq_len): fresh, decode-like, chunked


def _slopes(num_heads: int) -> torch.Tensor:
    """Slopes as steep as Bloom's first heads (2^-1 ..), so the bias dominates over 97 positions."""
    return torch.tensor([2.0 ** -(1 + i) for i in range(num_heads)], dtype=torch.float32)


def test_reference_matches_hf_bloom_and_mpt_bias_forms():
    # HF Bloom adds slope * key_position, HF MPT slope * (key_position - last_position); the reference adds
    # slope * (key_position - query_position). Per query row they differ by a constant: same softmax.
    q, k, v = torch.randn(7, 4, 16), torch.randn(12, 4, 16), torch.randn(12, 4, 16)
    slopes = _slopes(4)
    ours = attend_one_request(q, k, v, torch.arange(5, 12), scale=0.25, alibi_slopes=slopes)
    q_pos, k_pos = torch.arange(5, 12)[:, None], torch.arange(12)[None, :]
    causal = torch.where(k_pos <= q_pos, 0.0, torch.finfo(torch.float32).min)
    logits = q.transpose(0, 1) @ k.permute(1, 2, 0) * 0.25  # [heads, 7, 12]
    for bias in (k_pos.float(), (k_pos - 11).float()):  # Bloom's, MPT's
        probs = torch.softmax(logits + slopes[:, None, None] * bias + causal, dim=-1)
        torch.testing.assert_close(ours, (probs @ v.transpose(0, 1)).transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_alibi_changes_the_output():
    kv = make_paged_kv([40], num_kv_heads=2, head_dim=16, block_size=4, kv_dtype=torch.float32)
    args = (torch.randn(1, 4, 16), kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    plain = paged_decode_attention_reference(*args, scale=0.25)
    with_alibi = paged_decode_attention_reference(*args, scale=0.25, alibi_slopes=_slopes(4))
    assert (with_alibi - plain).abs().max() > 0.1


def _decode_case(seq_lens, *, num_q_heads, num_kv_heads, block_size, q_dtype=torch.float32, **options):
    kv = make_paged_kv(seq_lens, num_kv_heads=num_kv_heads, head_dim=16, block_size=block_size, kv_dtype=q_dtype)
    query = torch.randn(len(seq_lens), num_q_heads, 16).to(q_dtype)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    options = dict(scale=0.25, alibi_slopes=_slopes(num_q_heads), **options)
    return args, options, paged_decode_attention_reference(*args, **options)


def _prefill_case(requests, *, num_q_heads, num_kv_heads, block_size, q_dtype=torch.float32, **options):
    query_lens, seq_lens = zip(*requests)
    kv = make_paged_kv(list(seq_lens), num_kv_heads=num_kv_heads, head_dim=16, block_size=block_size, kv_dtype=q_dtype)
    query = torch.randn(sum(query_lens), num_q_heads, 16).to(q_dtype)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc(list(query_lens)), kv.seq_lens)
    options = dict(scale=0.25, alibi_slopes=_slopes(num_q_heads), **options)
    return args, options, paged_prefill_attention_reference(*args, **options)


@pytest.mark.parametrize("cpu_kernel", ["native", "compiled", "sdpa"])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("extra", [{}, {"sliding_window": 9, "softcap": 2.0, "sinks": torch.tensor([1.0] * 6)}])
def test_cpu_decode_matches_the_reference(cpu_kernel, num_q_heads, num_kv_heads, extra):
    extra = {**extra, "sinks": extra["sinks"][:num_q_heads]} if "sinks" in extra else extra
    args, options, expected = _decode_case(
        DECODE_LENGTHS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=4, **extra
    )
    assert_attention_close(paged_decode_attention(*args, cpu_kernel=cpu_kernel, **options), expected, torch.float32)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "block_size"), [(4, 4, 4), (6, 2, 1), (6, 3, 16)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_matches_the_reference(num_q_heads, num_kv_heads, block_size, q_dtype):
    args, options, expected = _prefill_case(
        PREFILL_REQUESTS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=block_size, q_dtype=q_dtype
    )
    assert_attention_close(paged_prefill_attention(*args, **options), expected, q_dtype)


def test_cpu_prefill_with_window_softcap_and_sinks():
    args, options, expected = _prefill_case(
        PREFILL_REQUESTS, num_q_heads=4, num_kv_heads=2, block_size=4, sliding_window=6, softcap=3.0,
        sinks=torch.tensor([0.5, 1.0, 1.5, 2.0]),
    )  # fmt: skip
    assert_attention_close(paged_prefill_attention(*args, **options), expected, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "block_size"), [(4, 4, 4), (6, 2, 8)])
def test_triton_decode_matches_the_reference(num_splits, num_q_heads, num_kv_heads, block_size):
    args, options, expected = _decode_case(
        DECODE_LENGTHS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=block_size
    )
    assert_attention_close(_launch_paged_decode(*args, num_splits=num_splits, **options), expected, torch.float32)


def test_triton_decode_fp16_with_window():
    args, options, expected = _decode_case(
        DECODE_LENGTHS, num_q_heads=4, num_kv_heads=2, block_size=4, q_dtype=torch.float16, sliding_window=20
    )
    assert_attention_close(_launch_paged_decode(*args, num_splits=3, **options), expected, torch.float16)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "block_size"), [(4, 4, 4), (6, 2, 8)])
def test_triton_prefill_matches_the_reference(num_q_heads, num_kv_heads, block_size):
    args, options, expected = _prefill_case(
        PREFILL_REQUESTS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=block_size
    )
    assert_attention_close(_launch_paged_prefill(*args, **options), expected, torch.float32)


def test_triton_prefill_fp16_with_window():
    args, options, expected = _prefill_case(
        PREFILL_REQUESTS, num_q_heads=4, num_kv_heads=2, block_size=4, q_dtype=torch.float16, sliding_window=6
    )
    assert_attention_close(_launch_paged_prefill(*args, **options), expected, torch.float16)


@pytest.mark.parametrize(
    "slopes",
    [torch.zeros(3), torch.zeros(4, dtype=torch.float16), torch.zeros(8)[::2]],
    ids=["shape", "dtype", "strided"],
)
def test_rejects_bad_slopes(slopes):
    kv = make_paged_kv([5], num_kv_heads=2, head_dim=16, block_size=4, kv_dtype=torch.float32)
    args = (torch.randn(1, 4, 16), kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    with pytest.raises(ValueError, match="alibi_slopes"):
        paged_decode_attention(*args, scale=1.0, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="alibi_slopes"):
        _launch_paged_decode(*args, scale=1.0, alibi_slopes=slopes)
