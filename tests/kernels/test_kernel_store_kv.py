"""Triton ``store_kv`` against the reference (bit-exact), plus fp8 round-trip error bounds."""

from __future__ import annotations

import pytest
import torch

from tgi_paged_kernels import store_kv
from tgi_paged_kernels.kv_store import _launch_store_kv
from tgi_paged_kernels.reference import dequantize, store_kv_reference
from tgi_paged_kernels.testing import fp8_round_trip_bound

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
ALL_CACHE_DTYPES = [torch.float16, torch.bfloat16, torch.float32, *FP8]


def make_tokens(num_tokens, num_blocks, block_size, num_kv_heads, head_dim, src_dtype, scale=1.0):
    """Random K/V rows, distinct shuffled slots, every third token padding (slot -1)."""
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::3] = -1
    key = (torch.randn(num_tokens, num_kv_heads, head_dim) * scale).to(src_dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_dim) * scale).to(src_dtype)
    return key, value, slots


def nan_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    return torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan")).to(dtype)


def assert_same_bits(actual, expected):
    # Byte comparison: NaN == NaN here, and untouched slots must stay NaN.
    assert torch.equal(actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))


def check_against_reference(store, key, value, slots, shape, cache_dtype, k_scale=1.0, v_scale=1.0):
    k_cache, v_cache = nan_pool(*shape, cache_dtype), nan_pool(*shape, cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    store_kv_reference(key, value, k_ref, v_ref, slots, k_scale=k_scale, v_scale=v_scale)
    assert_same_bits(k_cache, k_ref)
    assert_same_bits(v_cache, v_ref)


@pytest.mark.parametrize("store", [_launch_store_kv, store_kv], ids=["triton", "torch"])
@pytest.mark.parametrize("cache_dtype", ALL_CACHE_DTYPES, ids=str)
def test_every_cache_dtype(cache_dtype, store):
    # fp8 caches take fp16 rows, the others rows of their own dtype (what the runner does).
    src_dtype = torch.float16 if cache_dtype in FP8 else cache_dtype
    key, value, slots = make_tokens(17, 4, 16, 3, 80, src_dtype, scale=2.0)
    check_against_reference(store, key, value, slots, (4, 16, 3, 80), cache_dtype, k_scale=0.5, v_scale=3.0)


@pytest.mark.parametrize("store", [_launch_store_kv, store_kv], ids=["triton", "torch"])
@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32])
def test_every_block_size(block_size, store):
    # Block size 1: slot == block id. The pool has 30 blocks' worth of slots at least for 20 tokens.
    num_blocks = max(3, 30 // block_size)
    key, value, slots = make_tokens(20, num_blocks, block_size, 2, 64, torch.float16)
    check_against_reference(store, key, value, slots, (num_blocks, block_size, 2, 64), torch.float16)


@pytest.mark.parametrize("block_size", [1, 2])
def test_small_blocks_interleaved_pool_fp8(block_size):
    num_blocks = 40 // block_size
    pool = torch.full((num_blocks, 2, block_size, 3, 80), float("nan")).to(torch.float8_e4m3fn)
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    key, value, slots = make_tokens(17, num_blocks, block_size, 3, 80, torch.float16, scale=2.0)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    _launch_store_kv(key, value, k_cache, v_cache, slots, k_scale=0.5, v_scale=3.0)
    store_kv_reference(key, value, k_ref, v_ref, slots, k_scale=0.5, v_scale=3.0)
    assert_same_bits(k_cache, k_ref)
    assert_same_bits(v_cache, v_ref)


def test_interleaved_pool_and_fused_qkv_rows():
    pool = torch.full((3, 2, 16, 2, 64), float("nan")).half()
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    qkv = torch.randn(10, 4 + 2 + 2, 64).half()
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([5, -1, 47, 0, 16, 31, -7, 32, 1, 2])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    _launch_store_kv(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    assert_same_bits(k_cache, k_ref)
    assert_same_bits(v_cache, v_ref)


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_fp8_round_trip_within_half_an_ulp(cache_dtype):
    # Values across the range (x 1e-4 .. x 30, scaled), so normals and subnormals both occur.
    scale = 0.05
    key = torch.randn(24, 2, 64) * scale * torch.logspace(-4, 1.5, 24)[:, None, None]
    slots = torch.arange(24)
    k_cache, v_cache = nan_pool(2, 16, 2, 64, cache_dtype), nan_pool(2, 16, 2, 64, cache_dtype)
    _launch_store_kv(key, key, k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
    read_back = dequantize(k_cache.flatten(0, 1)[:24], scale)
    assert (read_back - key).abs().le(fp8_round_trip_bound(cache_dtype, scale, key)).all()


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_fp8_saturates_instead_of_overflowing(cache_dtype):
    finite_max = torch.finfo(cache_dtype).max
    key = torch.tensor([1e9, -1e9, float("inf"), 1.0]).repeat_interleave(16).reshape(4, 1, 16)
    k_cache, v_cache = nan_pool(1, 8, 1, 16, cache_dtype), nan_pool(1, 8, 1, 16, cache_dtype)
    _launch_store_kv(key, key, k_cache, v_cache, torch.arange(4))
    stored = k_cache[0, :4, 0, 0].float()
    assert stored.tolist() == [finite_max, -finite_max, finite_max, 1.0]


def test_rejects_bad_arguments():
    k_cache, v_cache = nan_pool(2, 16, 2, 64, torch.float16), nan_pool(2, 16, 2, 64, torch.float16)
    key = torch.randn(3, 2, 64).half()
    with pytest.raises(ValueError, match="key must be"):
        _launch_store_kv(key[:, :1], key, k_cache, v_cache, torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        _launch_store_kv(key, key, k_cache, v_cache, torch.arange(3).float())
    with pytest.raises(ValueError, match="KV cache dtype"):
        _launch_store_kv(key, key, k_cache.double(), v_cache.double(), torch.arange(3))
