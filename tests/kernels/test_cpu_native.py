"""The native C++ CPU kernels (``tgi_paged_kernels.cpu_native``) against their torch references, the build
cache, and the fallbacks when they cannot build."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

import tgi_paged_kernels.cpu_native as cpu_native
from tgi_paged_kernels import paged_decode_attention
from tgi_paged_kernels.cpu_decode import decode_attention_math
from tgi_paged_kernels.reference import paged_decode_attention_reference
from tgi_paged_kernels.testing import assert_attention_close, make_paged_kv

CASES = [
    # (num_q_heads, num_kv_heads, head_dim, block_size, kv dtype, softcap, window, sinks)
    (9, 3, 64, 16, torch.float32, 0.0, None, False),  # SmolLM2's geometry (a specialised head_dim)
    (2, 1, 64, 16, torch.float32, 0.0, 9, False),  # the host-bound model's, with a window
    (4, 1, 24, 4, torch.float32, 0.0, None, False),  # MQA, a head_dim with no specialisation
    (4, 2, 128, 4, torch.float32, 30.0, 5, False),  # Gemma 2: soft-cap and a window
    (8, 2, 256, 8, torch.float32, 0.0, 6, True),  # sinks and a window
    (4, 2, 16, 4, torch.float8_e4m3fn, 0.0, None, False),
    (4, 2, 16, 4, torch.float8_e5m2, 0.0, None, True),
    (4, 4, 64, 1, torch.bfloat16, 0.0, None, False),  # one token per block
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}q{c[1]}kv{c[2]}d-bs{c[3]}-{c[4]}-cap{c[5]}-w{c[6]}-s{c[7]}"
)
@pytest.mark.parametrize("interleaved", [False, True], ids=["split-pools", "one-pool"])
def test_decode_matches_the_reference(native, case, interleaved):
    """NaN-poisoned unowned slots, GQA/MQA, soft-cap, windows, sinks, fp8/bf16 pools, K/V interleaved."""
    num_q_heads, num_kv_heads, head_dim, block_size, kv_dtype, softcap, window, use_sinks = case
    generator = torch.Generator().manual_seed(0)
    seq_lens = [1, 7, 13, 29, 3, 40]
    kv = make_paged_kv(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, kv_dtype=kv_dtype,
        k_scale=0.5, v_scale=1.5, interleaved=interleaved, generator=generator,
    )  # fmt: skip
    query = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=generator)
    sinks = torch.randn(num_q_heads, generator=generator) * 2 if use_sinks else None
    options = dict(scale=head_dim**-0.5, softcap=softcap, sliding_window=window, k_scale=0.5, v_scale=1.5, sinks=sinks)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    expected = paged_decode_attention_reference(*args, **options)
    got = native.decode_attention(*args, options["scale"], softcap, window, sinks, 0.5, 1.5)
    assert torch.isfinite(got).all()
    assert_attention_close(got, expected, torch.float32)
    # The public function takes it by default and returns the query's dtype.
    assert_attention_close(paged_decode_attention(*args, **options), expected, torch.float32)


def test_decode_reads_strided_queries_int64_tables_and_bf16_queries(native):
    kv = make_paged_kv([9, 4, 21], num_kv_heads=2, head_dim=16, block_size=4, kv_dtype=torch.float32)
    hf_layout = torch.randn(1, 4, 3, 16)
    view = hf_layout[0].transpose(0, 1)  # what the attention hook passes: a view of HF's [1, Hq, T, D]
    expected = paged_decode_attention_reference(view.contiguous(), kv.k_cache, kv.v_cache, kv.block_tables,
                                                kv.seq_lens, scale=0.25)  # fmt: skip
    tables64, lens64 = kv.block_tables.long(), kv.seq_lens.long()
    got = native.decode_attention(view, kv.k_cache, kv.v_cache, tables64, lens64, 0.25, 0.0, None, None, 1.0, 1.0)
    assert_attention_close(got, expected, torch.float32)
    bf16 = paged_decode_attention(view.bfloat16(), kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale=0.25)
    assert bf16.dtype == torch.bfloat16
    assert_attention_close(bf16, expected, torch.bfloat16)


def test_decode_agrees_with_the_plain_torch_statement_of_the_math(native):
    """The same function the compiled kernel compiles, run eagerly, on the serving geometry."""
    generator = torch.Generator().manual_seed(1)
    kv = make_paged_kv([150, 3, 77, 16], num_kv_heads=3, head_dim=64, block_size=16, kv_dtype=torch.float32,
                       poison=False, generator=generator)  # fmt: skip
    query = torch.randn(4, 9, 64, generator=generator)
    table = kv.block_tables.long()
    expected = decode_attention_math(query, kv.k_cache, kv.v_cache, table, kv.seq_lens, 0.125, 0.0, None, None, 1, 1)
    got = native.decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, 0.0, None,
                                  None, 1.0, 1.0)  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_request_with_no_tokens_gets_zeros(native):
    kv = make_paged_kv([5, 1], num_kv_heads=1, head_dim=8, block_size=4, kv_dtype=torch.float32)
    lens = torch.tensor([5, 0], dtype=torch.int32)
    got = native.decode_attention(torch.randn(2, 2, 8), kv.k_cache, kv.v_cache, kv.block_tables, lens, 0.3, 0.0,
                                  None, None, 1.0, 1.0)  # fmt: skip
    assert torch.equal(got[1], torch.zeros(2, 8))


def test_bad_tables_raise_before_any_read_outside_them(native):
    kv = make_paged_kv([5, 20], num_kv_heads=1, head_dim=16, block_size=8, kv_dtype=torch.float32)
    query = torch.randn(2, 1, 16)
    too_long = torch.tensor([5, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens up to 40 need 5 blocks, block_tables has 4"):
        native.decode_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, too_long, 1.0, 0.0, None, None, 1, 1)
    outside = kv.block_tables.clone()
    outside[1, 2] = kv.k_cache.shape[0]
    with pytest.raises(ValueError, match="block id outside the pool's"):
        native.decode_attention(query, kv.k_cache, kv.v_cache, outside, kv.seq_lens, 1.0, 0.0, None, None, 1, 1)
    outside[1, 2] = -1
    with pytest.raises(ValueError, match="block id outside the pool's"):
        native.decode_attention(query, kv.k_cache, kv.v_cache, outside, kv.seq_lens, 1.0, 0.0, None, None, 1, 1)


def test_the_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    """Cached in a directory it creates 0700, the library not group-writable even under a umask of 002 (so
    the next start, which checks both, loads it)."""
    cache = tmp_path / "cache" / "kernels"
    monkeypatch.setenv("TGI_PAGED_KERNEL_CACHE", str(cache))
    umask = os.umask(0o002)
    try:
        first = cpu_native.build_library()
    except RuntimeError as e:
        pytest.skip(f"cannot build here: {e}")
    finally:
        os.umask(umask)
    assert first.parent == cache and first.is_file()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and not first.stat().st_mode & 0o022
    stamp = first.stat().st_mtime_ns
    assert cpu_native.build_library() == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in cache.iterdir()] == [first.name]  # no staging leftovers


@pytest.mark.parametrize(("mode", "who"), [(0o777, "group and others"), (0o775, "its group")])
def test_a_cache_directory_others_can_write_is_refused(tmp_path, monkeypatch, mode, who):
    """Refused before anything is built or loaded (``false`` as the compiler: it is never run)."""
    monkeypatch.setenv("TGI_PAGED_KERNEL_CACHE", str(tmp_path))
    tmp_path.chmod(mode)
    with pytest.raises(RuntimeError, match=f"refusing .* {tmp_path}: {tmp_path} is writable by {who}.*chmod"):
        cpu_native.build_library(compiler="false")


def test_a_cached_library_others_can_write_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TGI_PAGED_KERNEL_CACHE", str(tmp_path))
    planted = cpu_native.library_path("false")
    planted.write_bytes(b"not a library")
    planted.chmod(0o666)
    with pytest.raises(cpu_native.UnsafeKernelCache, match=f"{planted} is writable by group and others"):
        cpu_native.build_library(compiler="false")
    planted.chmod(0o644)
    assert cpu_native.build_library(compiler="false") == planted  # private: the cached build is used


def test_a_cache_of_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TGI_PAGED_KERNEL_CACHE", str(tmp_path))
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.raises(RuntimeError, match=f"{tmp_path} is owned by uid {uid}, not by this user .*TGI_PAGED_KERNEL"):
        cpu_native.build_library(compiler="false")


def test_a_cached_library_of_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TGI_PAGED_KERNEL_CACHE", str(tmp_path))
    planted = cpu_native.library_path("false")
    planted.write_bytes(b"not a library")
    planted.chmod(0o755)

    def stat_as_planted_by_another(path):
        real = os.stat(path)
        if path != planted:
            return real
        return os.stat_result((real.st_mode, real.st_ino, real.st_dev, real.st_nlink, real.st_uid + 1, *real[5:10]))

    monkeypatch.setattr(cpu_native, "_stat", stat_as_planted_by_another)
    with pytest.raises(cpu_native.UnsafeKernelCache, match=f"{planted} is owned by uid {os.getuid() + 1}"):
        cpu_native.build_library(compiler="false")


def test_an_unsafe_cache_leaves_serving_to_the_torch_paths_with_a_warning(tmp_path, monkeypatch, caplog):
    """As without a compiler: ``native_kernels()`` is ``None`` and the reason is logged at warning level."""
    monkeypatch.setenv("TGI_PAGED_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # refused before it would build
    tmp_path.chmod(0o777)
    cpu_native.native_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
            assert cpu_native.native_kernels() is None
    finally:
        cpu_native.native_kernels.cache_clear()
    [record] = [r for r in caplog.records if r.name == cpu_native.__name__]
    assert record.levelno == logging.WARNING
    assert f"refusing to load native CPU kernels from the kernel cache {tmp_path}" in record.getMessage()


def test_a_failing_compiler_names_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("TGI_PAGED_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="false failed"):
        cpu_native.build_library(compiler="false")


def test_without_native_kernels_the_compiled_and_gather_paths_serve(monkeypatch):
    monkeypatch.setattr("tgi_paged_kernels.torch_impl.native_kernels", lambda: None)
    kv = make_paged_kv([6, 11], num_kv_heads=2, head_dim=8, block_size=4, kv_dtype=torch.float32)
    args = (torch.randn(2, 4, 8), kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    expected = paged_decode_attention_reference(*args, scale=0.3)
    assert_attention_close(paged_decode_attention(*args, scale=0.3), expected, torch.float32)


def test_the_switch_turns_them_off(monkeypatch):
    monkeypatch.setenv("TGI_PAGED_NATIVE_CPU", "0")
    cpu_native.native_kernels.cache_clear()
    try:
        assert cpu_native.native_kernels() is None
    finally:
        cpu_native.native_kernels.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 5, 64), (3, 576), (700, 128), (1, 1, 24)])
def test_rms_norm_matches_torch(native, dtype, shape):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=generator) * 3).to(dtype)
    weight = (torch.rand(shape[-1], generator=generator) + 0.5).to(dtype)
    got = native.rms_norm(x, weight, 1e-5)
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, torch.rms_norm(x, (shape[-1],), weight, 1e-5), rtol=1e-6, atol=1e-6)
    else:  # transformers' Llama form in bf16: normalise in fp32, round, scale by the bf16 weight
        xf = x.float()
        expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        torch.testing.assert_close(got, expected, rtol=0.01, atol=0.01)
        assert (got != expected).float().mean() < 0.01  # the same roundings: at most rare last-bit ties


def test_rms_norm_reads_row_strided_views_and_declines_other_inputs(native):
    wide = torch.randn(4, 96)
    view = wide[:, :64]  # rows of 64 with a row stride of 96
    weight = torch.rand(64) + 0.5
    torch.testing.assert_close(native.rms_norm(view, weight, 1e-6), torch.rms_norm(view, (64,), weight, 1e-6))
    assert native.rms_norm(torch.randn(2, 64, dtype=torch.float16), weight.half(), 1e-6) is None
    assert native.rms_norm(torch.randn(2, 64), weight.bfloat16(), 1e-6) is None
    assert native.rms_norm(wide.t(), torch.rand(4), 1e-6) is None  # the normalised dim is not contiguous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_transformers_bit_for_bit(native, dtype):
    """x * cos + rotate_half(x) * sin on strided [T, H, D] views, as transformers computes it."""
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 5, 64, generator=generator).to(dtype)
    x = qkv[:, :4]  # the query and key heads of a fused projection: a row-strided view
    cos, sin = (torch.randn(7, 64, generator=generator).to(dtype) for _ in range(2))
    got = native.rope_neox(x, cos, sin)
    rotated = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    expected = (x * cos[:, None]) + (rotated * sin[:, None])
    assert got is not None and got.is_contiguous()
    assert torch.equal(got, expected)
    assert native.rope_neox(x, cos.float() if dtype == torch.bfloat16 else cos.bfloat16(), sin) is None
    assert native.rope_neox(x[..., :63], cos[:, :63].contiguous(), sin[:, :63].contiguous()) is None  # odd head_dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(native, dtype):
    generator = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(1, 6, 2 * 96, generator=generator) * 4).to(dtype)
    got = native.silu_and_mul(gate_up)
    expected = torch.nn.functional.silu(gate_up[..., :96]) * gate_up[..., 96:]
    assert got is not None and got.shape == (1, 6, 96)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("interleaved", [False, True], ids=["contiguous-kv", "strided-kv"])
def test_store_kv_writes_the_slots_and_skips_negative_ones(native, interleaved):
    pool = torch.zeros(6, 2, 4, 2, 8)  # [blocks, K/V, block_size, heads, head_dim]
    k_cache, v_cache = pool[:, 0].contiguous(), pool[:, 1].contiguous()
    qkv = torch.randn(3, 6, 8)
    # strided: views of a fused projection, key and value with different strides (value from a wider row)
    wider = torch.randn(3, 9, 8)
    key, value = (qkv[:, 2:4], wider[:, 7:9]) if interleaved else (torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    slots = torch.tensor([5, -1, 10])
    assert native.store_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_v[10], value[2])
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == 2  # slot of the skipped token untouched
    with pytest.raises(ValueError, match="slot outside the pool's 24 slots"):
        native.store_kv(key, value, k_cache, v_cache, torch.tensor([0, 1, 24]))
    fp8 = torch.zeros(6, 4, 2, 8, dtype=torch.float8_e4m3fn)
    assert not native.store_kv(key, value, fp8, fp8.clone(), slots)  # needs quantising: the torch path's job


def test_decode_splits_work_both_ways(native, monkeypatch):
    """Few requests: a task per (request, KV head); many: a task per request with all its heads. Same result."""
    generator = torch.Generator().manual_seed(2)
    kv = make_paged_kv([33] * 9, num_kv_heads=3, head_dim=64, block_size=16, kv_dtype=torch.float32,
                       generator=generator)  # fmt: skip
    query = torch.randn(9, 9, 64, generator=generator)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    expected = paged_decode_attention_reference(*args, scale=0.125)
    for threads in (1, 8):  # 9 requests >= 2 x 1 thread: whole rows; < 2 x 8 threads: one head per task
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        got = native.decode_attention(*args, 0.125, 0.0, None, None, 1.0, 1.0)
        assert_attention_close(got, expected, torch.float32)


def test_decode_refuses_shapes_the_kernel_would_read_past(native):
    kv = make_paged_kv([5, 9], num_kv_heads=2, head_dim=16, block_size=4, kv_dtype=torch.float32)
    args = (kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.25, 0.0, None)
    with pytest.raises(ValueError, match="does not fit a pool"):
        native.decode_attention(torch.randn(2, 4, 32), *args, None, 1.0, 1.0)  # head_dim 32 over a 16 pool
    with pytest.raises(ValueError, match="does not fit a pool"):
        native.decode_attention(torch.randn(2, 3, 16), *args, None, 1.0, 1.0)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="a row per request"):
        native.decode_attention(torch.randn(3, 4, 16), *args, None, 1.0, 1.0)
    with pytest.raises(ValueError, match="one value per query head"):
        native.decode_attention(torch.randn(2, 4, 16), *args, torch.zeros(3), 1.0, 1.0)
    half = kv.k_cache.half()
    with pytest.raises(ValueError, match="no native kernel for a torch.float16 pool"):
        native.decode_attention(torch.randn(2, 4, 16), half, half, *args[2:], None, 1.0, 1.0)
