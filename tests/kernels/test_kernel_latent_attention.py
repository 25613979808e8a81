"""Unequal key/value widths (multi-head latent attention): a latent pool holds one ``Dk``-wide entry per token
and V is the strided view ``k_cache[..., :Dv]``; queries are ``Dk`` wide, outputs ``Dv``. The CPU paths
(native kernel or its torch fallback, compiled, SDPA) against the reference, MQA (every query head on one KV
head) and GQA, fp32/bf16/fp8 pools, NaN-poisoned unowned slots; key-only ``store_kv``; a separate narrower
(not a view) V pool with its own fp8 scale; the Triton kernels under the interpreter (K split in two
dots past V's padded width).
"""

from __future__ import annotations

import pytest
import torch

from tgi_paged_kernels import copy_blocks, paged_decode_attention, paged_prefill_attention, store_kv
from tgi_paged_kernels._attention_tiles import HeadDimBlocks, head_dim_blocks
from tgi_paged_kernels.block_copy import _launch_copy_blocks
from tgi_paged_kernels.kv_store import _launch_store_kv
from tgi_paged_kernels.paged_decode import _launch_paged_decode
from tgi_paged_kernels.paged_prefill import _launch_paged_prefill
from tgi_paged_kernels.reference import (
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    store_kv_reference,
)
from tgi_paged_kernels.testing import assert_attention_close, make_paged_kv, query_start_loc

# (num_q_heads, num_kv_heads, Dk, Dv, block_size, kv dtype)
CASES = [
    (4, 1, 24, 16, 4, torch.float32),  # MQA, as MLA decodes
    (4, 1, 48, 32, 8, torch.float8_e4m3fn),
    (6, 2, 24, 16, 4, torch.bfloat16),  # GQA with narrower V
]
CASE_IDS = [f"{c[0]}q{c[1]}kv-k{c[2]}v{c[3]}-bs{c[4]}-{str(c[5]).split('.')[-1]}" for c in CASES]
SEQ_LENS = [1, 7, 13, 29, 3]


def _latent_pool(case, *, separate_v: bool = False, v_scale: float = 0.5):
    """A latent pool (V a view of K), or with ``separate_v`` a copy of that V in a pool of its own, read with
    ``v_scale``; returns the pool and the scales to pass."""
    num_q_heads, num_kv_heads, dk, dv, block_size, kv_dtype = case
    generator = torch.Generator().manual_seed(0)
    kv = make_paged_kv(
        SEQ_LENS, num_kv_heads=num_kv_heads, head_dim=dk, block_size=block_size, kv_dtype=kv_dtype,
        k_scale=0.5, latent_v_head_dim=dv, generator=generator,
    )  # fmt: skip
    assert kv.v_cache.data_ptr() == kv.k_cache.data_ptr() and not kv.v_cache.is_contiguous()
    v_cache = kv.v_cache.contiguous() if separate_v else kv.v_cache
    return kv, v_cache, dict(k_scale=0.5, v_scale=v_scale if separate_v else 0.5)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("cpu_kernel", ["native", "compiled", "sdpa"])
@pytest.mark.parametrize("separate_v", [False, True], ids=["view", "separate"])
def test_decode_with_a_narrower_value(case, cpu_kernel, separate_v):
    num_q_heads, _, dk, dv, _, _ = case
    kv, v_cache, scales = _latent_pool(case, separate_v=separate_v, v_scale=1.5)
    query = torch.randn(len(SEQ_LENS), num_q_heads, dk)
    args = (query, kv.k_cache, v_cache, kv.block_tables, kv.seq_lens)
    expected = paged_decode_attention_reference(*args, scale=dk**-0.5, **scales)
    assert expected.shape == (len(SEQ_LENS), num_q_heads, dv) and torch.isfinite(expected).all()
    got = paged_decode_attention(*args, scale=dk**-0.5, cpu_kernel=cpu_kernel, **scales)
    assert got.shape == expected.shape
    assert_attention_close(got, expected, torch.float32)


@pytest.mark.parametrize("case", CASES[:2], ids=CASE_IDS[:2])
def test_decode_soft_cap_sinks_and_window_with_a_narrower_value(case):
    """The per-KV-head path (soft-capping, sinks) and a sliding window, into an ``out`` buffer ``Dv`` wide."""
    num_q_heads, _, dk, dv, _, _ = case
    kv, v_cache, scales = _latent_pool(case)
    query = torch.randn(len(SEQ_LENS), num_q_heads, dk)
    options = dict(scale=dk**-0.5, softcap=20.0, sliding_window=6, sinks=torch.randn(num_q_heads), **scales)
    args = (query, kv.k_cache, v_cache, kv.block_tables, kv.seq_lens)
    out = torch.empty(len(SEQ_LENS), num_q_heads, dv)
    assert paged_decode_attention(*args, out=out, **options) is out
    assert_attention_close(out, paged_decode_attention_reference(*args, **options), torch.float32)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("separate_v", [False, True], ids=["view", "separate"])
@pytest.mark.parametrize("softcap", [0.0, 10.0])
def test_prefill_with_a_narrower_value(case, separate_v, softcap):
    num_q_heads, _, dk, dv, _, _ = case
    kv, v_cache, scales = _latent_pool(case, separate_v=separate_v, v_scale=1.5)
    starts = query_start_loc([1, 7, 5, 29, 2])  # new tokens per request: whole prompts and extends
    query = torch.randn(int(starts[-1]), num_q_heads, dk)
    args = (query, kv.k_cache, v_cache, kv.block_tables, starts, kv.seq_lens)
    expected = paged_prefill_attention_reference(*args, scale=dk**-0.5, softcap=softcap, **scales)
    assert expected.shape == (int(starts[-1]), num_q_heads, dv) and torch.isfinite(expected).all()
    got = paged_prefill_attention(*args, scale=dk**-0.5, softcap=softcap, **scales)
    assert_attention_close(got, expected, torch.float32)


def test_prefill_fresh_latent_kv_is_read_without_the_pool():
    """``new_kv`` for a latent layer: the key is the entry, the value its first ``Dv`` columns."""
    case = CASES[0]
    num_q_heads, num_kv_heads, dk, dv, block_size, kv_dtype = case
    latent = torch.randn(9, num_kv_heads, dk)
    kv = make_paged_kv([9], num_kv_heads=num_kv_heads, head_dim=dk, block_size=block_size, kv_dtype=kv_dtype,
                       latent_v_head_dim=dv)  # fmt: skip
    slots = torch.tensor([int(kv.block_tables[0, p // block_size]) * block_size + p % block_size for p in range(9)])
    store_kv(latent, None, kv.k_cache, None, slots)
    starts, query = query_start_loc([9]), torch.randn(9, num_q_heads, dk)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens)
    got = paged_prefill_attention(*args, scale=0.2, new_kv=(latent, latent[..., :dv]))
    assert_attention_close(got, paged_prefill_attention_reference(*args, scale=0.2), torch.float32)


STORES = [pytest.param(_launch_store_kv, id="triton"), pytest.param(store_kv, id="torch")]


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_key_only_store_writes_the_latent_entry(store, kv_dtype):
    """``store_kv(latent, None, k_cache, None, ...)`` as the reference writes it (bit for bit), negative slots
    skipped; the V view then reads the entry's first columns."""
    k_cache = torch.zeros(6, 4, 1, 24, dtype=kv_dtype)
    expected = k_cache.clone()
    latent = (torch.randn(5, 1, 24) * 3).to(torch.float16 if kv_dtype.itemsize == 1 else kv_dtype)
    slots = torch.tensor([3, -1, 17, 0, 22])
    store(latent, None, k_cache, None, slots, k_scale=0.75)
    store_kv_reference(latent, None, expected, None, slots, k_scale=0.75)
    assert torch.equal(k_cache.view(torch.uint8), expected.view(torch.uint8))
    assert k_cache.flatten(0, 1)[5].float().abs().sum() == 0  # slot 5 was not in the mapping


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e5m2])
def test_store_of_a_narrower_value_into_its_own_pool(store, kv_dtype):
    k_cache, v_cache = torch.zeros(4, 4, 2, 24, dtype=kv_dtype), torch.zeros(4, 4, 2, 16, dtype=kv_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    key, value, slots = torch.randn(3, 2, 24), torch.randn(3, 2, 16), torch.tensor([1, -1, 14])
    store(key, value, k_cache, v_cache, slots, k_scale=0.5, v_scale=2.0)
    store_kv_reference(key, value, k_ref, v_ref, slots, k_scale=0.5, v_scale=2.0)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


def test_mismatched_widths_are_refused():
    k_cache = torch.zeros(4, 4, 1, 16)
    query, tables, lens = torch.randn(2, 4, 16), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="exceeds"):  # V wider than K
        paged_decode_attention(query, k_cache, torch.zeros(4, 4, 1, 24), tables, lens, scale=1.0)
    with pytest.raises(ValueError, match="out must be"):  # out as wide as the query, not as V
        paged_decode_attention(query, k_cache, k_cache[..., :8], tables, lens, scale=1.0, out=torch.empty(2, 4, 16))
    with pytest.raises(ValueError, match="together"):
        store_kv(torch.randn(1, 1, 16), None, k_cache, k_cache[..., :8], torch.tensor([0]))
    with pytest.raises(ValueError, match="value must be"):
        store_kv(torch.randn(1, 1, 16), torch.randn(1, 1, 16), k_cache, k_cache[..., :8], torch.tensor([0]))


@pytest.mark.parametrize("separate_v", [False, True], ids=["view", "separate"])
def test_native_decode_reads_a_latent_view_and_leaves_other_narrow_pools_to_torch(native, monkeypatch, separate_v):
    """The C++ decode kernel reads V with K's strides: it serves the latent view (V = K's first columns) and a
    narrower pool of other strides takes the torch path; both match the reference."""
    calls = []
    real = type(native).decode_attention

    def spy(self, *args, **kwargs):
        calls.append(args[2].shape)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(native), "decode_attention", spy)
    case = CASES[1]  # fp8, MQA
    kv, v_cache, scales = _latent_pool(case, separate_v=separate_v, v_scale=1.5)
    query = torch.randn(len(SEQ_LENS), case[0], case[2])
    args = (query, kv.k_cache, v_cache, kv.block_tables, kv.seq_lens)
    got = paged_decode_attention(*args, scale=0.3, cpu_kernel="native", **scales)
    assert calls == ([] if separate_v else [v_cache.shape])
    assert_attention_close(got, paged_decode_attention_reference(*args, scale=0.3, **scales), torch.float32)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_native_decode_of_a_latent_pool_at_a_deepseek_width(native, kv_dtype):
    """Dk = 576 (512 latent + 64 rope), Dv = 512, 16 query heads on one KV head, block size 16."""
    kv = make_paged_kv([40, 17], num_kv_heads=1, head_dim=576, block_size=16, kv_dtype=kv_dtype,
                       k_scale=0.25, latent_v_head_dim=512)  # fmt: skip
    query = torch.randn(2, 16, 576)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    options = dict(scale=192**-0.5, k_scale=0.25, v_scale=0.25)
    got = native.decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 192**-0.5, 0.0, None,
                                  None, 0.25, 0.25)  # fmt: skip
    assert got.shape == (2, 16, 512)
    assert_attention_close(got, paged_decode_attention_reference(*args, **options), torch.float32)


# (num_q_heads, num_kv_heads, Dk, Dv, block_size, query dtype, kv dtype): Dk 48 = 32 + a 16-wide tail dot,
# Dk 24 / Dv 20 fits V's padded 32 (one K block), fp8 with fp16 queries.
TRITON_CASES = [
    (4, 1, 24, 16, 4, torch.float32, torch.float32),
    (4, 1, 48, 32, 8, torch.float16, torch.float8_e4m3fn),
    (6, 2, 24, 20, 4, torch.float16, torch.float16),
]
TRITON_IDS = [f"{c[0]}q{c[1]}kv-k{c[2]}v{c[3]}-{str(c[6]).split('.')[-1]}" for c in TRITON_CASES]


def _triton_case(case, lens):
    num_q_heads, num_kv_heads, dk, dv, block_size, q_dtype, kv_dtype = case
    kv = make_paged_kv(lens, num_kv_heads=num_kv_heads, head_dim=dk, block_size=block_size, kv_dtype=kv_dtype,
                       k_scale=0.5, latent_v_head_dim=dv)  # fmt: skip
    return kv, dict(scale=dk**-0.5, k_scale=0.5, v_scale=0.5)


def test_head_dim_blocks_split_k_past_v():
    assert head_dim_blocks(128, 128, "decode") == HeadDimBlocks(128, 16, False, 128)  # equal widths: as ever
    assert head_dim_blocks(576, 512, "decode") == HeadDimBlocks(512, 64, True, 512)  # DeepSeek: 512 + 64
    assert head_dim_blocks(24, 20, "decode") == HeadDimBlocks(32, 16, False, 32)
    with pytest.raises(ValueError, match="not supported by the decode kernel"):
        head_dim_blocks(320, 320, "decode")
    with pytest.raises(ValueError, match="key/value widths"):
        head_dim_blocks(1024, 512, "decode")


@pytest.mark.parametrize("case", TRITON_CASES, ids=TRITON_IDS)
@pytest.mark.parametrize("num_splits", [1, 2])  # 2: split-K, partial outputs and their merge Dv wide
def test_triton_decode_with_a_narrower_value(case, num_splits):
    kv, options = _triton_case(case, [1, 9, 30])
    query = torch.randn(3, case[0], case[2]).to(case[5])
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    options.update(softcap=15.0, sinks=torch.randn(case[0]))
    got = _launch_paged_decode(*args, num_splits=num_splits, **options)
    assert got.shape == (3, case[0], case[3]) and got.dtype == case[5]
    assert_attention_close(got, paged_decode_attention_reference(*args, **options), case[5])


@pytest.mark.parametrize("case", TRITON_CASES, ids=TRITON_IDS)
def test_triton_prefill_with_a_narrower_value(case):
    kv, options = _triton_case(case, [5, 20])
    starts = query_start_loc([5, 7])  # a whole prompt and an extend over a cached prefix
    query = torch.randn(12, case[0], case[2]).to(case[5])
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens)
    out = torch.empty(12, case[0], case[3], dtype=case[5])
    assert _launch_paged_prefill(*args, out=out, sliding_window=6, **options) is out
    assert_attention_close(out, paged_prefill_attention_reference(*args, sliding_window=6, **options), case[5])


def test_triton_decode_and_prefill_at_a_deepseek_width():
    """Dk = 576 (512 latent + 64 rope) as a 512 + 64 dot, Dv = 512, 16 query heads on one latent head, fp16."""
    kv = make_paged_kv([3, 20], num_kv_heads=1, head_dim=576, block_size=16, kv_dtype=torch.float16,
                       latent_v_head_dim=512)  # fmt: skip
    query = torch.randn(2, 16, 576).half()
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    expected = paged_decode_attention_reference(*args, scale=192**-0.5)
    assert_attention_close(_launch_paged_decode(*args, scale=192**-0.5), expected, torch.float16)
    starts = query_start_loc([1, 1])  # prefill of one token per request: the decode's answer again
    got = _launch_paged_prefill(query, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens, scale=192**-0.5)
    assert_attention_close(got, expected, torch.float16)


def test_copy_blocks_of_a_latent_layer_copies_the_entries():
    """A latent layer's V view has no whole blocks: ``copy_blocks`` copies its K in its place (the Triton copy
    then gets K twice, which it takes)."""
    k_cache = torch.randn(5, 4, 1, 24)
    expected = k_cache.clone()
    expected[[3, 4]] = expected[[0, 2]]
    copy_blocks([k_cache], [k_cache[..., :16]], torch.tensor([0, 2]), torch.tensor([3, 4]))
    assert torch.equal(k_cache, expected)
    _launch_copy_blocks([k_cache], [k_cache], torch.tensor([1]), torch.tensor([0]))  # the interpreter, as on CUDA
    expected[0] = expected[1]
    assert torch.equal(k_cache, expected)
