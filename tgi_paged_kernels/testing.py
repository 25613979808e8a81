"""Builders for paged test cases and the comparison tolerances, shared by ``tests/kernels`` and
``examples/bench_paged_attention.py`` (in the spirit of ``flashinfer.testing``).

A case is adversarial by construction:

- physical blocks are handed out in shuffled order, so token order != memory order;
- with ``poison=True`` every slot no request owns (including the tail of each last block) and a
  spare "poison" block hold NaN, and every block-table entry past a request's last block points at
  the poison block: a kernel that reads a single slot it should not turns its output into NaN;
- ``interleaved=True`` makes K and V views of one ``[num_blocks, 2, block_size, heads, dim]``
  tensor, so neither is contiguous;
- ``latent_v_head_dim=Dv`` makes a latent (MLA) pool: one cache, V the strided view ``k_cache[..., :Dv]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import cdiv, is_fp8
from .reference import quantize

# Per query dtype: (atol, rtol) for attention outputs against the fp32 reference, compared in fp32.
ATTENTION_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # fp32 dot products ("ieee"); only summation order and exp2 vs exp differ: measured <= 1e-6.
    torch.float32: (1e-5, 1e-5),
    # Relaxed: probabilities are rounded to fp16 before the P @ V product (2^-11 relative each) and
    # the output is rounded to fp16 (another 2^-11): measured <= 1e-3 at |out| ~ 3.
    torch.float16: (2e-3, 2e-3),
    # Relaxed: bf16 keeps 8 mantissa bits (ulp 2^-7 relative): probabilities rounded to bf16 on GPU
    # (half an ulp) plus the output rounding, which the Triton interpreter does by truncation (a
    # whole ulp): 1.5 ulp ~ 1.2e-2 relative; measured 1.5e-2 absolute at |out| ~ 2.
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass(frozen=True, slots=True)
class PagedKV:
    """One layer's pool plus the block tables and lengths of a batch of requests."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_requests, max_blocks + 1]: one column of poison padding
    seq_lens: torch.Tensor  # int32 [num_requests]
    k_scale: float
    v_scale: float
    poison_block: int


def make_paged_kv(
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_dtype: torch.dtype,
    device: str | torch.device = "cpu",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_spare_blocks: int = 2,
    poison: bool = True,
    interleaved: bool = False,
    latent_v_head_dim: int | None = None,
    generator: torch.Generator | None = None,
) -> PagedKV:
    """Random K/V for requests of the given lengths in a shuffled pool (see the module docstring).

    Owned slots hold ``quantize(N(0, 1) * scale)`` so fp8 values use their range; with
    ``poison=False`` the whole pool is random instead (no NaN; for benchmarks, generated block by
    block so huge pools need no fp32 staging copy). A latent pool (``latent_v_head_dim``) holds K only,
    written with ``k_scale``: read its V with ``v_scale == k_scale``.
    """
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + num_spare_blocks + 1  # + 1: the poison block, last
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if latent_v_head_dim is not None:
        if interleaved or not 0 < latent_v_head_dim <= head_dim:
            raise ValueError(f"a latent pool needs 0 < latent_v_head_dim <= {head_dim}, not interleaved")
        k_cache = torch.empty(shape, dtype=kv_dtype, device=device)
        v_cache = k_cache[..., :latent_v_head_dim]
    elif interleaved:
        pool = torch.empty((num_blocks, 2, *shape[1:]), dtype=kv_dtype, device=device)
        k_cache, v_cache = pool[:, 0], pool[:, 1]
    else:
        k_cache = torch.empty(shape, dtype=kv_dtype, device=device)
        v_cache = torch.empty(shape, dtype=kv_dtype, device=device)
    poison_block = num_blocks - 1
    written = ((k_cache, k_scale),) if latent_v_head_dim is not None else ((k_cache, k_scale), (v_cache, v_scale))
    for cache, scale in written:
        if poison:
            cache.copy_(torch.full(shape, float("nan"), device=device).to(kv_dtype))
        else:
            _fill_random_by_block(cache, scale, generator)

    block_tables = _shuffled_block_tables(seq_lens, block_size, num_blocks, generator)
    for b, seq_len in enumerate(seq_lens):
        if not poison or seq_len == 0:
            continue  # without poison the whole pool is random already
        positions = torch.arange(seq_len)
        block_ids = block_tables[b, positions // block_size].long().to(device)
        offsets = (positions % block_size).to(device)
        for cache, scale in written:
            values = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(device) * scale
            cache[block_ids, offsets] = quantize(values, kv_dtype, scale)
    return PagedKV(
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        k_scale=k_scale,
        v_scale=v_scale,
        poison_block=poison_block,
    )


def _shuffled_block_tables(seq_lens, block_size: int, num_blocks: int, generator) -> torch.Tensor:
    """Distinct physical blocks in random order, one extra column; padding -> the last (poison) block."""
    num_used = sum(cdiv(n, block_size) for n in seq_lens)
    physical = torch.randperm(num_blocks - 1, generator=generator)[:num_used].to(torch.int32)
    max_blocks = max([cdiv(n, block_size) for n in seq_lens], default=0)
    block_tables = torch.full((len(seq_lens), max_blocks + 1), num_blocks - 1, dtype=torch.int32)
    next_block = 0
    for b, seq_len in enumerate(seq_lens):
        num_request_blocks = cdiv(seq_len, block_size)
        block_tables[b, :num_request_blocks] = physical[next_block : next_block + num_request_blocks]
        next_block += num_request_blocks
    return block_tables


def _fill_random_by_block(cache: torch.Tensor, scale: float, generator: torch.Generator | None) -> None:
    chunk = max(1, (64 << 20) // max(1, cache[0].numel() * 4))  # blocks per 64 MiB of fp32 staging
    for start in range(0, cache.shape[0], chunk):
        part = cache[start : start + chunk]
        if generator is None:  # on the pool's device: a GPU fills tens of GiB in seconds
            values = torch.randn(part.shape, device=cache.device)
        else:  # seeded: generators live on the CPU
            values = torch.randn(part.shape, generator=generator).to(cache.device)
        part.copy_(quantize(values * scale, cache.dtype, scale))


def query_start_loc(query_lens: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """int32 [num_requests + 1] prefix sums of the per-request query lengths, starting at 0."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def fp8_round_trip_bound(dtype: torch.dtype, scale: float, x: torch.Tensor) -> torch.Tensor:
    """Largest |dequantize(quantize(x)) - x| allowed for round-to-nearest into ``dtype``.

    Half an ulp: relative 2^-(mantissa bits + 1) for normal values, plus half the smallest
    subnormal (absolute, times ``scale``) for values that land in the subnormal range.
    """
    if not is_fp8(dtype):
        raise ValueError(f"{dtype} is not an fp8 dtype")
    mantissa_bits = 3 if dtype == torch.float8_e4m3fn else 2
    smallest_subnormal = torch.finfo(dtype).smallest_normal * 2.0**-mantissa_bits
    return x.abs() * 2.0 ** -(mantissa_bits + 1) + 0.5 * smallest_subnormal * scale


def assert_attention_close(actual: torch.Tensor, expected: torch.Tensor, query_dtype: torch.dtype) -> None:
    """Compare an attention output with the fp32 reference under ``ATTENTION_TOLERANCES``."""
    atol, rtol = ATTENTION_TOLERANCES[query_dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)
