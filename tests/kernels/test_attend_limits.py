"""Prefill attention with per-row key limits (bidirectional spans: Gemma 3's images, PaliGemma's prefix-LM prompt)
against the fp32 reference: the reference itself against a dense mask built the way transformers builds it
(``OR(causal, same span)``, ``AND`` the sliding window), then the torch CPU path, the native CPU kernel and the
Triton kernel (under ``TRITON_INTERPRET=1``) against the reference; limits outside a row's range are refused."""

from __future__ import annotations

import pytest
import torch

from tgi_paged_kernels import paged_prefill_attention
from tgi_paged_kernels.cpu_prefill import prefill_attention
from tgi_paged_kernels.paged_prefill import _launch_paged_prefill
from tgi_paged_kernels.reference import gather_request_kv, paged_prefill_attention_reference
from tgi_paged_kernels.testing import assert_attention_close, make_paged_kv, query_start_loc

# (query tokens, tokens in the pool, spans as (start, stop) positions): a fresh prompt with two images; a chunk
# over a cached prefix starting inside a span (a prefix hit mid-image); a whole prompt as one span (prefix-LM); a
# causal request with no span; a one-token chunk that ends a span.
REQUESTS = [
    (30, 30, [(3, 11), (14, 27)]),
    (12, 40, [(25, 36)]),
    (21, 21, [(0, 21)]),
    (9, 9, []),
    (1, 17, [(4, 17)]),
]


def limits_of(requests) -> torch.Tensor:
    """int32 ``[T]``: each packed row's last visible key (its span's last position, else its own)."""
    rows = []
    for q_len, seq_len, spans in requests:
        for position in range(seq_len - q_len, seq_len):
            stop = next((b for a, b in spans if a <= position < b), position + 1)
            rows.append(stop - 1)
    return torch.tensor(rows, dtype=torch.int32)


def dense_expected(query, kv, requests, scale, window) -> torch.Tensor:
    """One masked softmax per request and head over a ``[q, seq_len]`` mask: ``(causal or same span) and window``
    (transformers' ``create_masks_for_vision_model`` composition)."""
    out, row = [], 0
    for b, (q_len, seq_len, spans) in enumerate(requests):
        k = gather_request_kv(kv.k_cache, kv.block_tables[b], seq_len, 1.0)
        v = gather_request_kv(kv.v_cache, kv.block_tables[b], seq_len, 1.0)
        group = torch.full((seq_len,), -1)
        for i, (a, stop) in enumerate(spans):
            group[a:stop] = i
        q_pos = torch.arange(seq_len - q_len, seq_len)
        k_pos = torch.arange(seq_len)
        mask = (k_pos[None] <= q_pos[:, None]) | ((group[q_pos][:, None] == group[None]) & (group[q_pos][:, None] >= 0))
        if window is not None:
            mask &= k_pos[None] > q_pos[:, None] - window
        q = query[row : row + q_len].float()
        heads = []
        for h in range(q.shape[1]):
            kv_head = h // (q.shape[1] // k.shape[1])
            scores = (q[:, h] @ k[:, kv_head].T * scale).masked_fill(~mask, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v[:, kv_head])
        out.append(torch.stack(heads, 1))
        row += q_len
    return torch.cat(out)


def case(window=None, num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4, q_dtype=torch.float32):
    generator = torch.Generator().manual_seed(1)
    kv = make_paged_kv([r[1] for r in REQUESTS], num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                       kv_dtype=q_dtype, generator=generator)  # fmt: skip
    query = torch.randn(sum(r[0] for r in REQUESTS), num_q_heads, head_dim, generator=generator).to(q_dtype)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc([r[0] for r in REQUESTS]), kv.seq_lens)
    options = dict(scale=head_dim**-0.5, sliding_window=window, attend_limits=limits_of(REQUESTS))
    return kv, args, options


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
def test_reference_is_the_or_of_causal_and_span_masks(window) -> None:
    kv, args, options = case(window)
    expected = dense_expected(args[0], kv, REQUESTS, options["scale"], window)
    got = paged_prefill_attention_reference(*args, **options)
    assert_attention_close(got, expected, torch.float32)
    causal = paged_prefill_attention_reference(*args, **{**options, "attend_limits": None})
    assert not torch.allclose(causal, got, atol=1e-3)  # the spans change the rows inside them


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
@pytest.mark.parametrize("sinks", [False, True], ids=["sdpa", "per-kv-head"])
def test_torch_path_matches_the_reference(window, sinks, monkeypatch) -> None:
    monkeypatch.setattr("tgi_paged_kernels.torch_impl.prefill_attention", lambda *a, **k: None)  # not native
    kv, args, options = case(window)
    if sinks:
        options["sinks"] = torch.randn(args[0].shape[1])
    expected = paged_prefill_attention_reference(*args, **options)
    assert_attention_close(paged_prefill_attention(*args, **options), expected, torch.float32)
    # The fresh requests' keys read from the new K/V instead of the pool: the same values, the same result.
    new_k, new_v = (
        torch.cat(
            [gather_request_kv(cache, kv.block_tables[b], n, 1.0)[n - q :] for b, (q, n, _) in enumerate(REQUESTS)]
        )
        for cache in (kv.k_cache, kv.v_cache)
    )
    got = paged_prefill_attention(*args, **options, new_kv=(new_k, new_v))
    assert_attention_close(got, expected, torch.float32)


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_native_kernel_matches_the_reference(native, window, block_size) -> None:
    kv, args, options = case(window, block_size=block_size)
    expected = paged_prefill_attention_reference(*args, **options)
    got = prefill_attention(native, *args, softcap=0.0, sinks=None, k_scale=1.0, v_scale=1.0, **options)
    assert got is not None
    assert_attention_close(got, expected, torch.float32)


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 2), (3, 1)], ids=["gqa2", "gqa3"])
def test_triton_kernel_matches_the_reference(window, num_q_heads, num_kv_heads) -> None:
    kv, args, options = case(window, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, q_dtype=torch.float16)
    expected = paged_prefill_attention_reference(*args, **options)
    got = _launch_paged_prefill(*args, **options)
    assert_attention_close(got, expected, torch.float16)


def test_limits_outside_a_rows_range_are_refused(native, monkeypatch) -> None:
    kv, args, options = case()
    for bad_row, value in ((0, 40), (5, 2)):  # past seq_len; before the row's own position
        limits = options["attend_limits"].clone()
        limits[bad_row] = value
        with pytest.raises(ValueError, match="limit"):
            prefill_attention(native, *args, softcap=0.0, sinks=None, k_scale=1.0, v_scale=1.0,
                              **{**options, "attend_limits": limits})  # fmt: skip
        with monkeypatch.context() as m:
            m.setattr("tgi_paged_kernels.torch_impl.prefill_attention", lambda *a, **k: None)
            with pytest.raises(ValueError, match="attend_limits"):
                paged_prefill_attention(*args, **{**options, "attend_limits": limits})
    with pytest.raises(ValueError, match="attend_limits"):
        paged_prefill_attention(*args, **{**options, "attend_limits": options["attend_limits"][:-1]})
