"""The native decoder-layer kernels (``tgi_paged_kernels.cpu_layer``) against their torch references: the packed
GEMM, the whole Llama-form decode layer (K/V written included), a row's result independent of its batch, and
the errors on bad inputs."""

from __future__ import annotations

import pytest
import torch

from tgi_paged_kernels.cpu_layer import (
    LlamaLayerWeights,
    gemm_packed,
    gemm_packed_ref,
    llama_decode_layer,
    llama_decode_layer_ref,
    pack_weight,
)


@pytest.mark.parametrize(
    ("m", "k", "n", "bias"),
    [(1, 128, 256, False), (20, 128, 256, True), (13, 100, 37, True), (300, 64, 48, False), (25, 576, 960, False)],
)
def test_gemm_matches_the_reference(native, m, k, n, bias) -> None:
    """Row counts around the register tile (12 on AVX-512, 6 on AVX2), widths not a multiple of 16."""
    g = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = gemm_packed(native, x, pack_weight(w), n, b)
    expected = gemm_packed_ref(x, w, b)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5 * k**0.5)


def test_gemm_rows_do_not_depend_on_their_batch(native) -> None:
    """Every output is one sequential sum over k: a row gives the same bits alone and in any batch."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(29, 96, generator=g), torch.randn(70, 96, generator=g)
    packed = pack_weight(w)
    whole = gemm_packed(native, x, packed, 70)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 17), slice(28, 29)):
        assert torch.equal(gemm_packed(native, x[rows].contiguous(), packed, 70), whole[rows])


def test_pack_weight_refuses_other_kinds() -> None:
    with pytest.raises(ValueError, match="fp32"):
        pack_weight(torch.zeros(4, 4, dtype=torch.bfloat16))
    packed = pack_weight(torch.arange(6.0).view(3, 2))
    assert packed.shape == (1, 2, 16) and packed[0, :, :3].T.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert not packed[0, :, 3:].any()


def _layer(hq: int, hkv: int, d: int, hidden: int, inter: int, window: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    raw = dict(
        qkv=rand((hq + 2 * hkv) * d, hidden),
        qkv_bias=rand((hq + 2 * hkv) * d) if bias else None,
        o=rand(hidden, hq * d),
        gate_up=rand(2 * inter, hidden),
        down=rand(hidden, inter),
    )
    packed = LlamaLayerWeights(
        ln1=torch.rand(hidden, generator=g) + 0.5, eps1=1e-5, ln2=torch.rand(hidden, generator=g) + 0.5, eps2=1e-6,
        qkv=pack_weight(raw["qkv"]), qkv_bias=raw["qkv_bias"], o=pack_weight(raw["o"]),
        gate_up=pack_weight(raw["gate_up"]), down=pack_weight(raw["down"]), hidden_size=hidden, intermediate=inter,
        num_q_heads=hq, num_kv_heads=hkv, head_dim=d, scale=d**-0.5, window=window,
    )  # fmt: skip
    return raw, packed


def _step(lengths: list[int], block_size: int, kv_heads: int, d: int, index_dtype: torch.dtype, seed: int = 0):
    """Pools with random history, block tables (scattered blocks), the new tokens' slots."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = len(lengths) * width + 1
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = order[: len(lengths) * width].view(len(lengths), width).to(index_dtype)
    pools = [torch.randn(num_blocks, block_size, kv_heads, d, generator=g) for _ in range(2)]
    slots = torch.tensor(
        [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(lengths)]
    )
    return pools, tables, torch.tensor(lengths, dtype=index_dtype), slots


@pytest.mark.parametrize(
    ("hq", "hkv", "d", "window", "bias", "block_size", "index_dtype"),
    [
        (2, 1, 64, 0, False, 16, torch.int32),  # the host-bound model's geometry
        (9, 3, 64, 0, False, 16, torch.int64),  # SmolLM2's
        (4, 2, 32, 7, True, 4, torch.int32),  # a window (Mistral) and q/k/v biases (Qwen2), a generic head_dim
        (4, 4, 128, 0, False, 1, torch.int64),  # one token per block
    ],
)
def test_layer_matches_the_reference(native, hq, hkv, d, window, bias, block_size, index_dtype) -> None:
    hidden, inter = 96, 160
    raw, packed = _layer(hq, hkv, d, hidden, inter, window, bias)
    lengths = [1, 5, 17, 40, 33, 3, 16]
    (k_pool, v_pool), tables, seq_lens, slots = _step(lengths, block_size, hkv, d, index_dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(lengths), hidden, generator=g)
    cos, sin = torch.randn(len(lengths), d, generator=g), torch.randn(len(lengths), d, generator=g)
    ref_k, ref_v, k_before = k_pool.clone(), v_pool.clone(), k_pool.clone()
    got = llama_decode_layer(native, packed, x, cos, sin, k_pool, v_pool, slots, tables, seq_lens)
    expected = llama_decode_layer_ref(raw, packed, x, cos, sin, ref_k, ref_v, slots, tables, seq_lens)
    # Four GEMMs summed in another order than torch's: within 1e-4 (the load-time check's tolerance).
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k_pool, ref_k, rtol=1e-4, atol=1e-4)  # RoPE'd keys written to their slots
    torch.testing.assert_close(v_pool, ref_v, rtol=1e-4, atol=1e-4)
    assert (k_pool != k_before).any(dim=(1, 2, 3)).sum() == len(lengths)  # one slot per request, nothing else


def test_layer_refuses_a_slot_outside_the_pool(native) -> None:
    raw, packed = _layer(2, 1, 64, 128, 64, 0, False)
    (k_pool, v_pool), tables, seq_lens, slots = _step([4, 9], 16, 1, 64, torch.int32)
    x, cs = torch.randn(2, 128), torch.randn(2, 64)
    bad = slots.clone()
    bad[1] = k_pool.shape[0] * 16
    with pytest.raises(ValueError, match="slot outside the pool's"):
        llama_decode_layer(native, packed, x, cs, cs, k_pool, v_pool, bad, tables, seq_lens)
    # inputs of another kind: None, and the caller runs the per-op path
    assert llama_decode_layer(native, packed, x.double(), cs, cs, k_pool, v_pool, slots, tables, seq_lens) is None
    assert llama_decode_layer(native, packed, x, cs, cs, k_pool, v_pool, slots.int(), tables, seq_lens) is None
    with pytest.raises(ValueError, match="blocks"):  # a seq_len beyond the table's width
        llama_decode_layer(native, packed, x, cs, cs, k_pool, v_pool, slots, tables, seq_lens * 10)
