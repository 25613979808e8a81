"""Whole-block copies: inside the pool (copy-on-write of a shared prefix block) and between the pool
and the CPU swap space (preemption by swap).

``copy_blocks`` on CUDA is one Triton launch per layer covering K and V: program
(pair, chunk, K-or-V) copies ``CHUNK`` elements of block ``src[pair]`` to block ``dst[pair]``. A
block's ``block_size * num_kv_heads * head_dim`` elements must be contiguous (true for a plain pool
and for K/V views of one ``[num_blocks, 2, ...]`` tensor); the block stride is free. Destinations
must be distinct and disjoint from the sources, as copy-on-write guarantees (fresh blocks); the
programs run in no particular order.

Swapping crosses devices, which a kernel cannot do, so it is plain torch: gather the blocks on the
source device, move them in one transfer per layer through pinned host memory, scatter them on the
destination device. Swap-out (GPU -> CPU) queues every layer's transfer and synchronises once;
swap-in (CPU -> GPU) never synchronises.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_index, check_kv_cache, next_power_of_2

MAX_CHUNK = 4096  # elements per program: 8 KiB of fp16, enough to keep a copy program busy


@triton.jit
def _copy_blocks_kernel(
    k_cache_ptr,
    stride_kb,  # stride between blocks; a block's elements are contiguous
    v_cache_ptr,
    stride_vb,  #
    src_ptr,
    dst_ptr,  # [num_pairs] block ids
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,  #
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    is_value = tl.program_id(2)  # 0: K pool, 1: V pool
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    if is_value == 0:
        x = tl.load(k_cache_ptr + src * stride_kb + offs, mask=mask)
        tl.store(k_cache_ptr + dst * stride_kb + offs, x, mask=mask)
    else:
        x = tl.load(v_cache_ptr + src * stride_vb + offs, mask=mask)
        tl.store(v_cache_ptr + dst * stride_vb + offs, x, mask=mask)


def check_block_pairs(src: torch.Tensor, dst: torch.Tensor, src_device: torch.device, dst_device: torch.device) -> None:
    """``src``/``dst``: equally long 1-D int32/int64 block ids on their pools' devices."""
    if src.dim() != 1:
        raise ValueError(f"source block ids must be 1-D, got shape {tuple(src.shape)}")
    check_index("source block ids", src, None, src_device)
    check_index("destination block ids", dst, tuple(src.shape), dst_device)


def _launch_copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Check arguments and launch ``_copy_blocks_kernel`` once per layer, whatever the device.

    Parameters
    ----------
    k_caches, v_caches : per layer [num_blocks, block_size, num_kv_heads, head_dim], each block contiguous
    src, dst : int32/int64 [num_pairs] block ids on the pools' device; ``dst`` distinct, disjoint from ``src``
    """
    if len(k_caches) != len(v_caches):
        raise ValueError(f"{len(k_caches)} K pools but {len(v_caches)} V pools")
    for k_cache, v_cache in zip(k_caches, v_caches):
        check_kv_cache(k_cache, v_cache)
        check_block_pairs(src, dst, k_cache.device, k_cache.device)
        if not (k_cache[0].is_contiguous() and v_cache[0].is_contiguous()):
            raise ValueError(
                f"each block of the pool must be contiguous, got strides {k_cache.stride()}, {v_cache.stride()}"
            )
    if src.numel() == 0:
        return
    for k_cache, v_cache in zip(k_caches, v_caches):
        block_numel = k_cache[0].numel()
        chunk = min(MAX_CHUNK, next_power_of_2(block_numel))
        _copy_blocks_kernel[(src.numel(), triton.cdiv(block_numel, chunk), 2)](
            k_cache, k_cache.stride(0),  #
            v_cache, v_cache.stride(0),  #
            src, dst,  #
            BLOCK_NUMEL=block_numel, CHUNK=chunk,  #
        )  # fmt: skip


def swap_blocks_torch(src_caches, dst_caches, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Block ``src_ids[i]`` of each source pool -> block ``dst_ids[i]`` of the matching destination
    pool, any pair of devices (parameters: ``api.swap_blocks``)."""
    src_device, dst_device = src_caches[0].device, dst_caches[0].device
    src_idx = src_ids.to(src_device, torch.int64)
    dst_idx = dst_ids.to(dst_device, torch.int64)
    if src_device.type == "cuda" and dst_device.type == "cpu":
        # -- swap-out: gather on the GPU, queue every layer's copy into pinned memory, sync once ----
        staged = []
        for src in src_caches:
            host = torch.empty((len(src_idx), *src.shape[1:]), dtype=src.dtype, pin_memory=True)
            staged.append(host.copy_(src.index_select(0, src_idx), non_blocking=True))
        torch.cuda.current_stream(src_device).synchronize()  # the copies must land before the CPU reads them
        for dst, host in zip(dst_caches, staged):
            dst[dst_idx] = host
    elif src_device.type == "cpu" and dst_device.type == "cuda":
        # -- swap-in: gather into pinned memory, asynchronous copy, scatter on the GPU (stream order) -
        for src, dst in zip(src_caches, dst_caches):
            host = torch.empty((len(src_idx), *src.shape[1:]), dtype=src.dtype, pin_memory=True)
            torch.index_select(src, 0, src_idx, out=host)
            dst[dst_idx] = host.to(dst_device, non_blocking=True)
    else:
        for src, dst in zip(src_caches, dst_caches):
            dst[dst_idx] = src.index_select(0, src_idx).to(dst_device)
