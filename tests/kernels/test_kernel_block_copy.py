"""``copy_blocks`` (Triton and torch) and ``swap_blocks`` against the pair-by-pair references."""

from __future__ import annotations

import pytest
import torch

from tgi_paged_kernels import copy_blocks, swap_blocks
from tgi_paged_kernels.block_copy import _launch_copy_blocks
from tgi_paged_kernels.reference import copy_blocks_reference, swap_blocks_reference


def random_pools(num_layers, num_blocks, dtype, *, interleaved=False, block_shape=(8, 3, 80)):
    """Per layer a K and a V pool of random values (fp8 from fp32 randoms)."""
    k_caches, v_caches = [], []
    for _ in range(num_layers):
        if interleaved:
            pool = torch.randn(num_blocks, 2, *block_shape).to(dtype)
            k_caches.append(pool[:, 0])
            v_caches.append(pool[:, 1])
        else:
            k_caches.append(torch.randn(num_blocks, *block_shape).to(dtype))
            v_caches.append(torch.randn(num_blocks, *block_shape).to(dtype))
    return k_caches, v_caches


def assert_pools_equal(actual, expected):
    for a, e in zip(actual, expected):
        assert torch.equal(a.contiguous().view(torch.uint8), e.contiguous().view(torch.uint8))


# Copy-on-write pairs: sources may repeat (one shared block copied twice); destinations are fresh.
SRC = torch.tensor([3, 0, 3, 7])
DST = torch.tensor([5, 9, 1, 2])


@pytest.mark.parametrize("copy", [_launch_copy_blocks, copy_blocks], ids=["triton", "torch"])
@pytest.mark.parametrize(
    "dtype, interleaved",
    [(torch.float16, False), (torch.bfloat16, True), (torch.float8_e4m3fn, False), (torch.float32, True)],
    ids=["fp16", "bf16-interleaved", "fp8", "fp32-interleaved"],
)
def test_copy_blocks(copy, dtype, interleaved):
    k_caches, v_caches = random_pools(2, 10, dtype, interleaved=interleaved)
    k_ref, v_ref = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
    copy(k_caches, v_caches, SRC, DST)
    copy_blocks_reference(k_ref, v_ref, SRC, DST)
    assert_pools_equal(k_caches + v_caches, k_ref + v_ref)


@pytest.mark.parametrize("copy", [_launch_copy_blocks, copy_blocks], ids=["triton", "torch"])
@pytest.mark.parametrize("block_size", [1, 2])
@pytest.mark.parametrize("interleaved", [False, True], ids=["plain", "interleaved"])
def test_copy_blocks_small_block_sizes(copy, block_size, interleaved):
    k_caches, v_caches = random_pools(2, 10, torch.float16, interleaved=interleaved, block_shape=(block_size, 3, 80))
    k_ref, v_ref = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
    copy(k_caches, v_caches, SRC, DST)
    copy_blocks_reference(k_ref, v_ref, SRC, DST)
    assert_pools_equal(k_caches + v_caches, k_ref + v_ref)


def test_copy_blocks_rejects_scattered_blocks():
    k_caches, v_caches = random_pools(1, 10, torch.float16)
    transposed = [c.transpose(1, 2) for c in k_caches]  # block elements no longer contiguous
    with pytest.raises(ValueError, match="contiguous"):
        _launch_copy_blocks(transposed, transposed, SRC, DST)


@pytest.mark.parametrize(
    "dtype, block_size", [(torch.float16, 8), (torch.float8_e5m2, 8), (torch.float16, 1), (torch.float16, 2)], ids=str
)
def test_swap_blocks_between_cpu_pools(dtype, block_size):
    # Pool -> swap space and back, K and V of two layers in one call, int32 and int64 ids.
    pool_k, pool_v = random_pools(2, 10, dtype, block_shape=(block_size, 3, 80))
    swap_k, swap_v = random_pools(2, 6, dtype, block_shape=(block_size, 3, 80))
    src_ids, dst_ids = torch.tensor([7, 2, 4], dtype=torch.int32), torch.tensor([0, 5, 3])
    expected = [c.clone() for c in swap_k + swap_v]
    swap_blocks(pool_k + pool_v, swap_k + swap_v, src_ids, dst_ids)
    swap_blocks_reference(pool_k + pool_v, expected, src_ids, dst_ids)
    assert_pools_equal(swap_k + swap_v, expected)
    # ... and back into other pool blocks.
    expected = [c.clone() for c in pool_k + pool_v]
    swap_blocks(swap_k + swap_v, pool_k + pool_v, dst_ids, torch.tensor([1, 8, 9]))
    swap_blocks_reference(swap_k + swap_v, expected, dst_ids, torch.tensor([1, 8, 9]))
    assert_pools_equal(pool_k + pool_v, expected)


def test_swap_blocks_rejects_mismatched_pools():
    pool_k, _ = random_pools(1, 4, torch.float16)
    other_k, _ = random_pools(1, 4, torch.float16, block_shape=(16, 3, 80))
    with pytest.raises(ValueError, match="pool blocks differ"):
        swap_blocks(pool_k, other_k, torch.tensor([0]), torch.tensor([1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_swap_blocks_gpu_round_trip_through_pinned_memory():
    k_caches, v_caches = random_pools(1, 10, torch.float16)
    pool_k, pool_v = k_caches[0].cuda(), v_caches[0].cuda()
    swap_k = torch.zeros(6, 8, 3, 80, dtype=torch.float16).pin_memory()
    swap_blocks([pool_k], [swap_k], torch.tensor([7, 2]), torch.tensor([0, 5]))
    assert torch.equal(swap_k[[0, 5]], pool_k[[7, 2]].cpu())
    swap_blocks([swap_k], [pool_v], torch.tensor([0, 5]), torch.tensor([1, 3]))
    assert torch.equal(pool_v[[1, 3]].cpu(), swap_k[[0, 5]])
