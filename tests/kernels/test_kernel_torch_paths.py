"""The public functions on CPU tensors (plain-torch paths) against the references: at the CPU
serving shape (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, fp32, batch 32, contexts up
to ~1k) and over the same adversarial axes as the Triton tests (cheap here: no interpreter).
Also checks the reference itself against torch's SDPA on a contiguous sequence (layered references).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tgi_paged_kernels import paged_decode_attention, paged_prefill_attention, plan_decode_gather, store_kv
from tgi_paged_kernels.reference import (
    attend_one_request,
    paged_decode_attention_reference,
    paged_prefill_attention_reference,
    store_kv_reference,
)
from tgi_paged_kernels.testing import assert_attention_close, make_paged_kv, query_start_loc

SERVING = dict(num_kv_heads=3, head_dim=64, block_size=16, kv_dtype=torch.float32)


def test_reference_matches_sdpa_on_a_contiguous_sequence():
    q, k, v = torch.randn(7, 9, 64), torch.randn(12, 3, 64), torch.randn(12, 3, 64)
    ours = attend_one_request(q, k, v, torch.arange(5, 12), scale=0.125)
    # SDPA with the 7 queries as the last 7 of 12 positions: bottom-right aligned causal mask.
    mask = torch.ones(7, 12, dtype=torch.bool).tril(diagonal=5)
    k9, v9 = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1), k9.transpose(0, 1), v9.transpose(0, 1), attn_mask=mask,
                                          scale=0.125).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(ours, sdpa, atol=1e-5, rtol=1e-5)


def test_reference_sinks_match_the_gpt_oss_formula():
    # transformers' gpt-oss eager attention: concatenate the sink logit as a last column, softmax,
    # drop that column. Here on a contiguous sequence, with a window of 4 and GQA 3.
    q, k, v = torch.randn(7, 9, 16), torch.randn(12, 3, 16), torch.randn(12, 3, 16)
    sinks = torch.randn(9) * 3
    ours = attend_one_request(q, k, v, torch.arange(5, 12), scale=0.25, sliding_window=4, sinks=sinks)
    q_pos, k_pos = torch.arange(5, 12)[:, None], torch.arange(12)[None, :]
    mask = torch.where((k_pos <= q_pos) & (k_pos > q_pos - 4), 0.0, float("-inf"))
    k9, v9 = k.repeat_interleave(3, dim=1).transpose(0, 1), v.repeat_interleave(3, dim=1).transpose(0, 1)
    logits = q.transpose(0, 1) @ k9.transpose(1, 2) * 0.25 + mask  # [heads, 7, 12]
    combined = torch.cat([logits, sinks[:, None, None].expand(-1, 7, 1)], dim=-1)
    probs = torch.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    torch.testing.assert_close(ours, (probs @ v9).transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 1])  # 1: stock TGI's flashinfer layout, ~1k-entry block tables
def test_decode_at_serving_shape(block_size):
    seq_lens = torch.randint(1, 1025, (32,)).tolist()
    kv = make_paged_kv(seq_lens, **{**SERVING, "block_size": block_size})
    query = torch.randn(32, 9, 64)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    assert_attention_close(
        paged_decode_attention(*args, scale=0.125), paged_decode_attention_reference(*args, scale=0.125), torch.float32
    )


@pytest.mark.parametrize("block_size", [16, 1])
def test_prefill_at_serving_shape(block_size):
    requests = [(128, 128), (64, 700), (1, 1), (33, 257), (200, 1000)]  # (new tokens, tokens in pool)
    kv = make_paged_kv([n for _, n in requests], **{**SERVING, "block_size": block_size})
    starts = query_start_loc([q for q, _ in requests])
    query = torch.randn(int(starts[-1]), 9, 64)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens)
    assert_attention_close(
        paged_prefill_attention(*args, scale=0.125), paged_prefill_attention_reference(*args, scale=0.125),
        torch.float32,
    )  # fmt: skip


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(
    "q_dtype, kv_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float8_e4m3fn),
     (torch.float32, torch.float8_e5m2)],
    ids=["fp32", "bf16", "fp16-e4m3", "fp32-e5m2"],
)  # fmt: skip
@pytest.mark.parametrize(
    "softcap, sliding_window", [(0.0, None), (5.0, None), (0.0, 20), (5.0, 33)],
    ids=["plain", "softcap", "window", "both"],
)  # fmt: skip
def test_adversarial_grid(block_size, q_dtype, kv_dtype, softcap, sliding_window):
    # Every last-block fill, odd lengths, shuffled blocks, NaN in unowned slots, interleaved K/V.
    seq_lens = [fill + block_size * (fill % 3) for fill in range(1, block_size + 1)] + [1, 17, 97]
    kv = make_paged_kv(seq_lens, num_kv_heads=3, head_dim=80, block_size=block_size, kv_dtype=kv_dtype,
                       k_scale=0.5, v_scale=2.0, interleaved=True)  # fmt: skip
    kwargs = dict(scale=0.1, softcap=softcap, sliding_window=sliding_window, k_scale=0.5, v_scale=2.0)
    tables = (kv.k_cache, kv.v_cache, kv.block_tables)

    query = torch.randn(len(seq_lens), 9, 80).to(q_dtype)
    out = torch.empty_like(query)
    assert paged_decode_attention(query, *tables, kv.seq_lens, out=out, **kwargs) is out
    assert_attention_close(out, paged_decode_attention_reference(query, *tables, kv.seq_lens, **kwargs), q_dtype)

    query_lens = [min(n, 1 + n % 7) for n in seq_lens]
    starts = query_start_loc(query_lens)
    query = torch.randn(sum(query_lens), 9, 80).to(q_dtype)
    actual = paged_prefill_attention(query, *tables, starts, kv.seq_lens, **kwargs)
    expected = paged_prefill_attention_reference(query, *tables, starts, kv.seq_lens, **kwargs)
    assert actual.dtype == q_dtype
    assert_attention_close(actual, expected, q_dtype)


@pytest.mark.parametrize("block_size", [1, 2, 4])
@pytest.mark.parametrize(
    "q_dtype, kv_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float8_e4m3fn)],
    ids=["fp32", "fp16-e4m3"],
)  # fmt: skip
def test_adversarial_grid_small_blocks(block_size, q_dtype, kv_dtype):
    # The grid's case with softcap and window at 1-, 2- and 4-token pages (one block-table entry per key at 1).
    test_adversarial_grid(block_size, q_dtype, kv_dtype, softcap=5.0, sliding_window=33)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(
    "q_dtype, kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.float16, torch.float8_e4m3fn)], ids=["fp32", "bf16", "fp16-e4m3"],
)  # fmt: skip
@pytest.mark.parametrize("sliding_window", [None, 8], ids=["full", "window8"])
def test_attention_sinks(block_size, q_dtype, kv_dtype, sliding_window):
    # One sink logit per query head (gpt-oss), small and dominant ones, in decode and in prefill.
    seq_lens = [1, 5, 17, 40]
    kv = make_paged_kv(seq_lens, num_kv_heads=3, head_dim=16, block_size=block_size, kv_dtype=kv_dtype,
                       k_scale=0.5, v_scale=2.0)  # fmt: skip
    sinks = torch.tensor([0.5, -1.0, 0.0, 12.0, 9.0, -30.0, 2.0, 2.0, 2.0])
    kwargs = dict(scale=0.25, sliding_window=sliding_window, k_scale=0.5, v_scale=2.0, sinks=sinks)
    tables = (kv.k_cache, kv.v_cache, kv.block_tables)
    query = torch.randn(len(seq_lens), 9, 16).to(q_dtype)
    assert_attention_close(
        paged_decode_attention(query, *tables, kv.seq_lens, **kwargs),
        paged_decode_attention_reference(query, *tables, kv.seq_lens, **kwargs),
        q_dtype,
    )
    starts = query_start_loc([1, 3, 17, 6])
    query = torch.randn(int(starts[-1]), 9, 16).to(q_dtype)
    assert_attention_close(
        paged_prefill_attention(query, *tables, starts, kv.seq_lens, **kwargs),
        paged_prefill_attention_reference(query, *tables, starts, kv.seq_lens, **kwargs),
        q_dtype,
    )


@pytest.mark.parametrize(
    "cache_dtype, block_size", [(torch.float32, 16), (torch.float8_e4m3fn, 16), (torch.float32, 1),
                                (torch.float8_e4m3fn, 2)], ids=str,
)  # fmt: skip
def test_store_then_decode_round_trip(cache_dtype, block_size):
    # What the runner does each step: store the new token's K/V, then attend over the pool.
    kv = make_paged_kv([5, 16, 40], **{**SERVING, "kv_dtype": cache_dtype, "block_size": block_size})
    slots = torch.tensor([0, -1, 0])
    for b, seq_len in enumerate([5, 16, 40]):
        position = seq_len - 1  # overwrite each request's last position
        bs = block_size
        slots[b] = kv.block_tables[b, position // bs] * bs + position % bs if b != 1 else -1
    key, value = torch.randn(3, 3, 64), torch.randn(3, 3, 64)
    k_ref, v_ref = kv.k_cache.clone(), kv.v_cache.clone()
    store_kv(key, value, kv.k_cache, kv.v_cache, slots)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    assert torch.equal(kv.k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(kv.v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    query = torch.randn(3, 9, 64)
    actual = paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale=0.125)
    expected = paged_decode_attention_reference(query, k_ref, v_ref, kv.block_tables, kv.seq_lens, scale=0.125)
    assert_attention_close(actual, expected, torch.float32)


@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["sdpa", "per-kv-head"])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_one_decode_plan_serves_every_layer_of_a_step(sliding_window, softcap):
    # The runner builds the gather plan once per step and hands it to each layer: every layer's
    # result (its own pool and dtype, NaN in unowned slots; same block tables, as in one step)
    # equals the call that plans itself.
    seq_lens = [1, 9, 16, 17, 40]
    plan = None
    for kv_dtype in (torch.float32, torch.float8_e4m3fn, torch.float32):
        kv = make_paged_kv(seq_lens, num_kv_heads=2, head_dim=16, block_size=8, kv_dtype=kv_dtype,
                           k_scale=0.5, v_scale=2.0, generator=torch.Generator().manual_seed(0))  # fmt: skip
        if plan is None:
            plan = plan_decode_gather(kv.block_tables, kv.seq_lens, 8, sliding_window)
        query = torch.randn(len(seq_lens), 6, 16)
        args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
        kwargs = dict(scale=0.25, softcap=softcap, sliding_window=sliding_window, k_scale=0.5, v_scale=2.0)
        shared = paged_decode_attention(*args, gather=plan, **kwargs)
        assert torch.isfinite(shared).all()
        torch.testing.assert_close(shared, paged_decode_attention(*args, **kwargs), atol=0, rtol=0)
        assert_attention_close(shared, paged_decode_attention_reference(*args, **kwargs), torch.float32)
    with pytest.raises(ValueError, match="gather plan for 5 requests"):
        paged_decode_attention(query[:2], kv.k_cache, kv.v_cache, kv.block_tables[:2], kv.seq_lens[:2], scale=0.25,
                               gather=plan)  # fmt: skip


def test_cpu_paths_check_values():
    kv = make_paged_kv([5, 20], num_kv_heads=1, head_dim=16, block_size=8, kv_dtype=torch.float32)
    query = torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match="need 5 blocks"):
        paged_decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor([5, 40], dtype=torch.int32),
                               scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="query_start_loc must rise"):
        paged_prefill_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, torch.tensor([0, 2, 1]), kv.seq_lens,
                                scale=1.0)  # fmt: skip


def test_public_names_are_the_functions_after_every_submodule_import():
    # A submodule named like a public function would replace it on the package once imported.
    import importlib

    import tgi_paged_kernels

    for module in ("api", "block_copy", "cpu_attention", "fp8_gemm", "int_gemm", "kv_store", "paged_decode",
                   "paged_prefill", "reference", "testing", "torch_impl", "cpu_native", "cpu_layer", "cpu_lora",
                   "lora", "cpu_decode", "cpu_prefill"):  # fmt: skip
        importlib.import_module(f"tgi_paged_kernels.{module}")
    lazy = tgi_paged_kernels._LAZY  # names served from their own module on first use
    for name in tgi_paged_kernels.__all__:
        home = importlib.import_module(f"tgi_paged_kernels.{lazy[name]}") if name in lazy else tgi_paged_kernels.api
        assert getattr(tgi_paged_kernels, name) is getattr(home, name), name


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_prefill_of_fresh_requests_reads_their_new_kv_instead_of_the_pool(kv_dtype, monkeypatch):
    """The torch path (no native kernels, ALiBi, compiled): requests without a cached prefix attend over the
    K/V just computed (when the pool stores them as they are): the same result as reading the pool back. A
    request with a prefix still reads the pool. (Otherwise queries take the native kernel, which reads the pool.)"""
    monkeypatch.setattr("tgi_paged_kernels.torch_impl.prefill_attention", lambda *args, **kwargs: None)
    seq_lens = [5, 9, 12]
    q_lens = [5, 3, 12]  # the middle request extends a cached prefix of 6 tokens
    kv = make_paged_kv(seq_lens, num_kv_heads=2, head_dim=16, block_size=4, kv_dtype=kv_dtype,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip
    starts = torch.tensor([0, 5, 8, 20], dtype=torch.int32)
    rows = []
    for b, (n, q) in enumerate(zip(seq_lens, q_lens)):
        for pos in range(n - q, n):
            rows.append((kv.block_tables[b, pos // 4].item(), pos % 4))
    new_k = torch.stack([kv.k_cache[blk, slot] for blk, slot in rows]).float()
    new_v = torch.stack([kv.v_cache[blk, slot] for blk, slot in rows]).float()
    query = torch.randn(20, 4, 16)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, starts, kv.seq_lens)
    expected = paged_prefill_attention(*args, scale=0.25)
    got = paged_prefill_attention(*args, scale=0.25, new_kv=(new_k.to(kv_dtype), new_v.to(kv_dtype)))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    poisoned = (torch.full_like(new_k, float("nan")), torch.full_like(new_v, float("nan")))
    if kv_dtype == torch.float32:  # the fresh requests (0 and 2) now read the NaN K/V, request 1 the pool
        got = paged_prefill_attention(*args, scale=0.25, new_kv=poisoned)
        assert torch.isnan(got[:5]).all() and torch.isfinite(got[5:8]).all() and torch.isnan(got[8:]).all()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_bf16_prefill_queries_take_the_native_kernel_widened(kv_dtype, monkeypatch):
    """A bf16 model's prefill: its queries are widened to fp32 for the native kernel (one call for the step, as fp32
    queries), the output rounded back to bf16; the per-request torch path computes the same in fp32."""
    from tgi_paged_kernels import native_kernels, torch_impl

    if native_kernels() is None:
        pytest.skip("native kernels not built here")
    kv = make_paged_kv([7, 30, 19], num_kv_heads=3, head_dim=64, block_size=16, kv_dtype=kv_dtype,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip
    query = torch.randn(7 + 12 + 19, 9, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    args = (
        query,
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        torch.tensor([0, 7, 19, 38], dtype=torch.int32),
        kv.seq_lens,
    )
    calls = []
    widened = torch_impl.prefill_attention
    monkeypatch.setattr(torch_impl, "prefill_attention", lambda *a, **k: calls.append(a[1].dtype) or widened(*a, **k))
    got = paged_prefill_attention(*args, scale=0.125)
    assert calls == [torch.float32] and got.dtype == torch.bfloat16
    monkeypatch.setattr(torch_impl, "prefill_attention", lambda *a, **k: None)  # the per-request torch path
    expected = paged_prefill_attention(*args, scale=0.125)
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2)  # one bf16 rounding of fp32 sums apart
