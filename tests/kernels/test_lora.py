"""Batched multi-LoRA: the fp32 reference against PEFT-style ``nn.Linear`` math, and the Triton shrink /
expand kernels (under the interpreter) against the reference.

Shapes are tiny and not multiples of the tiles: in_features 200 against 128-wide K steps, out_features
100 against 64-wide output blocks, rank 24 against 16-wide rank blocks (so every loop has a masked
tail). Batches mix adapters: repeated slots, rows without one (-1), and a slot whose real rank (5) is
padded with zeros to the stack's rank.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from tgi_paged_kernels.cpu_lora import cpu_b_stack
from tgi_paged_kernels.lora import add_lora_triton, lora_delta_reference, lora_expand_, lora_shrink
from tgi_paged_kernels.testing import ATTENTION_TOLERANCES

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

IN_FEATURES, OUT_FEATURES, RANK = 200, 100, 24
RANKS = (24, 5, 16)  # real rank per slot; slot 1 is padded from 5 to RANK
SCALES = (2.0, 16 / 5**0.5, 0.5)  # lora_alpha / r, an rsLoRA alpha / sqrt(r), and one below 1
SLOTS = {1: [1], 7: [0, -1, 2, 0, 1, -1, 0]}  # per batch size: repeated slots and rows without an adapter


def _adapters(ranks=RANKS, rank=RANK, dtype=torch.float32, seed=0):
    """Zero-padded ``a_stack`` [S, rank, IN], ``b_stack`` [S, OUT, rank], ``scales`` and the unpadded (A, B) pairs."""
    g = torch.Generator().manual_seed(seed)
    a_stack = torch.zeros(len(ranks), rank, IN_FEATURES)
    b_stack = torch.zeros(len(ranks), OUT_FEATURES, rank)
    pairs = []
    for s, r in enumerate(ranks):
        a = (torch.randn(r, IN_FEATURES, generator=g) * 0.1).to(dtype)
        b = (torch.randn(OUT_FEATURES, r, generator=g) * 0.1).to(dtype)
        a_stack[s, :r], b_stack[s, :, :r] = a.float(), b.float()
        pairs.append((a, b))
    scales = torch.tensor(SCALES[: len(ranks)], dtype=torch.float32)
    return a_stack.to(dtype), b_stack.to(dtype), scales, pairs


def _batch(num_rows, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, IN_FEATURES, generator=g).to(dtype)
    slots = torch.tensor(SLOTS[num_rows], dtype=torch.int64)
    return x, slots


def _delta_fp32(x, slots, a_stack, b_stack, scales):
    """The reference on the same values, kept in fp32 (inputs of any dtype are exact in fp32)."""
    return lora_delta_reference(x.float(), slots, a_stack.float(), b_stack.float(), scales)


# -- the oracle ------------------------------------------------------------------------------------------


def test_reference_is_peft_linear_math_per_row():
    a_stack, b_stack, scales, pairs = _adapters()
    x, slots = _batch(7)
    got = lora_delta_reference(x, slots, a_stack, b_stack, scales)
    assert got.shape == (7, OUT_FEATURES) and got.dtype == torch.float32
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.equal(got[t], torch.zeros(OUT_FEATURES))
            continue
        a, b = pairs[s]  # unpadded: rank RANKS[s]
        lora_a = nn.Linear(IN_FEATURES, a.shape[0], bias=False, dtype=torch.float64)
        lora_b = nn.Linear(a.shape[0], OUT_FEATURES, bias=False, dtype=torch.float64)
        with torch.no_grad():
            lora_a.weight.copy_(a)
            lora_b.weight.copy_(b)
            want = lora_b(lora_a(x[t : t + 1].double())) * SCALES[s]
            by_hand = (x[t].double() @ a.double().T) @ b.double().T * SCALES[s]
        torch.testing.assert_close(want[0], by_hand)
        torch.testing.assert_close(got[t].double(), want[0], atol=1e-5, rtol=1e-5)


def test_reference_padding_changes_nothing_and_rounds_once_to_x_dtype():
    a_stack, b_stack, scales, pairs = _adapters()
    x, slots = _batch(7)
    got = lora_delta_reference(x, slots, a_stack, b_stack, scales)
    a, b = pairs[1]  # real rank 5 of 24
    rows = slots == 1
    unpadded = (x[rows] @ a.T) @ b.T * scales[1]
    torch.testing.assert_close(got[rows], unpadded, atol=1e-6, rtol=1e-6)
    # Rounded once at the end: the bf16 result is the fp32 one cast.
    bf16 = lora_delta_reference(x.bfloat16(), slots, a_stack, b_stack, scales)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, _delta_fp32(x.bfloat16(), slots, a_stack, b_stack, scales).bfloat16())


def test_reference_rejects_a_slot_past_the_stack():
    a_stack, b_stack, scales, _ = _adapters()
    x, slots = _batch(7)
    slots[3] = len(RANKS)
    with pytest.raises(ValueError, match="slot 3"):
        lora_delta_reference(x, slots, a_stack, b_stack, scales)


# -- the Triton kernels -----------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("num_rows", [1, 7])
def test_shrink_is_x_times_its_slots_a_and_zero_without_adapter(num_rows):
    a_stack, _, _, _ = _adapters()
    x, slots = _batch(num_rows)
    xa = lora_shrink(x, slots, a_stack)
    assert xa.shape == (num_rows, RANK) and xa.dtype == torch.float32
    for t, s in enumerate(slots.tolist()):
        want = torch.zeros(RANK) if s < 0 else x[t] @ a_stack[s].T
        torch.testing.assert_close(xa[t], want, atol=1e-5, rtol=1e-5)
    # Slot 1's A is zero past its real rank, so are those columns of xa.
    assert torch.equal(xa[slots == 1, RANKS[1] :], torch.zeros(int((slots == 1).sum()), RANK - RANKS[1]))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 7])
def test_add_lora_matches_reference(dtype, num_rows):
    a_stack, b_stack, scales, _ = _adapters(dtype=dtype)
    x, slots = _batch(num_rows, dtype)
    base = torch.randn(num_rows, OUT_FEATURES, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = base.clone()
    add_lora_triton(out, x, slots, a_stack, b_stack, scales)
    assert out.dtype == dtype
    want = base.float() + _delta_fp32(x, slots, a_stack, b_stack, scales)
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)
    no_adapter = slots < 0
    assert torch.equal(out[no_adapter], base[no_adapter])  # untouched, not rewritten with a rounding


@needs_triton
def test_add_lora_padded_rank_matches_the_unpadded_adapter():
    a_stack, b_stack, scales, pairs = _adapters()
    x, slots = _batch(7)
    out = torch.zeros(7, OUT_FEATURES)
    add_lora_triton(out, x, slots, a_stack, b_stack, scales)
    a, b = pairs[1]
    rows = slots == 1
    torch.testing.assert_close(out[rows], (x[rows] @ a.T) @ b.T * scales[1], atol=1e-5, rtol=1e-5)


@needs_triton
def test_add_lora_into_a_column_slice_leaves_its_neighbours():
    a_stack, b_stack, scales, _ = _adapters()
    x, slots = _batch(7)
    wide = torch.randn(7, 3 * OUT_FEATURES + 3)  # e.g. a fused projection's output; odd width
    before = wide.clone()
    out = wide[:, OUT_FEATURES + 1 : 2 * OUT_FEATURES + 1]
    assert not out.is_contiguous()
    add_lora_triton(out, x, slots, a_stack, b_stack, scales)
    want = before[:, OUT_FEATURES + 1 : 2 * OUT_FEATURES + 1] + _delta_fp32(x, slots, a_stack, b_stack, scales)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(wide[:, : OUT_FEATURES + 1], before[:, : OUT_FEATURES + 1])
    assert torch.equal(wide[:, 2 * OUT_FEATURES + 1 :], before[:, 2 * OUT_FEATURES + 1 :])


@needs_triton
def test_add_lora_reads_strided_inputs_and_accepts_empty_batches():
    a_stack, b_stack, scales, _ = _adapters()
    x, slots = _batch(7)
    x_strided = torch.stack([x, -x], dim=2)[:, :, 0]  # equal to x, with column stride 2
    assert x_strided.stride() == (2 * IN_FEATURES, 2)
    b_transposed = b_stack.transpose(1, 2).contiguous().transpose(1, 2)  # rank axis outermost in memory
    out = torch.zeros(7, OUT_FEATURES)
    add_lora_triton(out, x_strided, slots, a_stack, b_transposed, scales)
    torch.testing.assert_close(out, _delta_fp32(x, slots, a_stack, b_stack, scales), atol=1e-5, rtol=1e-5)
    empty = torch.zeros(0, OUT_FEATURES)
    add_lora_triton(empty, x[:0], slots[:0], a_stack, b_stack, scales)
    lora_expand_(empty, torch.zeros(0, RANK), slots[:0], b_stack, scales)


# -- the CPU serving path (csrc/cpu_lora.cpp) ------------------------------------------------------------


def _cpu_case(rows: int, slots: list[int], ranks: list[int], in_f: int = 96, out_f: int = 80, max_rank: int = 8):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, in_f, generator=gen)
    a = torch.zeros(len(ranks), max_rank, in_f)
    b = cpu_b_stack(len(ranks), out_f, max_rank, torch.float32)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, in_f, generator=gen)
        b[s, :, :r] = torch.randn(out_f, r, generator=gen)
    scales = torch.tensor([0.5 + s for s in range(len(ranks))], dtype=torch.float32)
    token_slots = torch.tensor(slots, dtype=torch.int64)
    base = torch.randn(rows, out_f, generator=gen)
    return base, x, token_slots, a, b, scales, torch.tensor(ranks, dtype=torch.int32)


def _assert_lora_close(out: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> None:
    """``out == base + delta`` up to fp32 sum order: the deltas here reach ~100 (sums of 96 products, then of 8),
    the outputs can cancel to ~0.3, so the slack is a few ulp of the largest delta (the AVX2 and AVX-512 builds sum
    in different orders; a wrong scale or row is off by whole units)."""
    slack = 4 * torch.finfo(torch.float32).eps * float(delta.abs().max())
    torch.testing.assert_close(out, base + delta, rtol=1e-5, atol=max(slack, 1e-5))


def test_cpu_native_lora_matches_the_reference(native) -> None:
    from tgi_paged_kernels.cpu_lora import add_lora_cpu

    base, x, slots, a, b, scales, ranks = _cpu_case(9, [0, -1, 2, 2, 1, -1, 0, 2, 1], [8, 3, 5])
    out = base.clone()
    assert add_lora_cpu(native, out, x, slots, a, b, scales, ranks)
    _assert_lora_close(out, base, lora_delta_reference(x, slots, a, b, scales))
    untouched = slots < 0
    assert torch.equal(out[untouched], base[untouched])  # no adapter: bit-identical
    # a row's bits do not depend on the other rows of the batch
    alone = base[4:5].clone()
    add_lora_cpu(native, alone, x[4:5], slots[4:5], a, b, scales, ranks)
    assert torch.equal(alone, out[4:5])


def test_cpu_native_lora_reads_strided_scales_that_it_copied(native) -> None:
    """A strided ``scales`` view is copied to contiguous memory for the kernel; that copy must live until the
    C++ call returns (issue 43: a temporary freed inside the argument list gave garbage scales every call)."""
    from tgi_paged_kernels.cpu_lora import add_lora_cpu

    base, x, slots, a, b, scales, ranks = _cpu_case(6, [0, 1, 2, 3, 2, 0], [8, 3, 5, 6])
    spread = torch.zeros(2 * scales.numel())
    spread[::2] = scales
    strided = spread[::2]
    assert not strided.is_contiguous() and torch.equal(strided, scales)
    delta = lora_delta_reference(x, slots, a, b, scales)
    for _ in range(20):
        out = base.clone()
        assert add_lora_cpu(native, out, x, slots, a, b, strided, ranks)
        _assert_lora_close(out, base, delta)


def test_cpu_native_lora_writes_a_column_slice_and_refuses_what_it_cannot_run(native) -> None:
    from tgi_paged_kernels.cpu_lora import add_lora_cpu

    base, x, slots, a, b, scales, ranks = _cpu_case(4, [1, 0, -1, 1], [2, 4], out_f=16)
    wide = torch.randn(4, 40)
    before = wide.clone()
    assert add_lora_cpu(native, wide[:, 8:24], x, slots, a, b, scales, ranks)
    expected = before[:, 8:24] + lora_delta_reference(x, slots, a, b, scales)
    torch.testing.assert_close(wide[:, 8:24], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 24:], before[:, 24:])
    assert not add_lora_cpu(native, base.double(), x.double(), slots, a.double(), b.double(), scales, ranks)
    with pytest.raises(ValueError, match="slot"):
        add_lora_cpu(native, base, x, torch.tensor([0, 5, 0, 0]), a, b, scales, ranks)


def test_cpu_native_lora_leaves_ranks_above_its_scratch_to_torch(native) -> None:
    from tgi_paged_kernels.cpu_lora import MAX_RANK, add_lora_cpu

    base, x, slots, a, b, scales, ranks = _cpu_case(2, [0, 0], [MAX_RANK + 1], max_rank=MAX_RANK + 1)
    out = base.clone()
    assert not add_lora_cpu(native, out, x, slots, a, b, scales, ranks)  # no error: the caller's torch path serves
    assert torch.equal(out, base)


def test_cpu_native_lora_bf16_stacks_give_the_bits_of_fp32_stacks_of_their_values(native) -> None:
    """An fp32 model's adapters saved in bf16: the per-layer kernel widens each value exactly (the prefill path)."""
    from tgi_paged_kernels.cpu_lora import add_lora_cpu

    base, x, slots, a, b, scales, ranks = _cpu_case(9, [0, -1, 2, 2, 1, -1, 0, 2, 1], [8, 3, 5])
    a16 = a.to(torch.bfloat16)
    b16 = cpu_b_stack(3, 80, 8, torch.bfloat16)
    b16.copy_(b)
    outs = []
    for a_s, b_s in ((a16, b16), (a16.float(), b16.float().transpose(1, 2).contiguous().transpose(1, 2))):
        out = base.clone()
        assert add_lora_cpu(native, out, x, slots, a_s, b_s, scales, ranks)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], base)
    assert not add_lora_cpu(native, base.clone(), x, slots, a16, b, scales, ranks)  # A and B of two dtypes: torch's


def test_cpu_native_lora_of_a_bf16_model_adds_in_fp32_and_rounds_once(native) -> None:
    """A bf16 model's prefill rows: bf16 ``out`` and ``x`` (a column slice of the fused output included) with bf16
    stacks; the result is the fp32 path's on the widened values, rounded once to bf16, in place."""
    from tgi_paged_kernels.cpu_lora import add_lora_cpu

    base, x, slots, a, b, scales, ranks = _cpu_case(5, [0, -1, 2, 1, 0], [8, 3, 5], out_f=16)
    a16, b16 = a.bfloat16(), cpu_b_stack(3, 16, 8, torch.bfloat16)
    b16.copy_(b)
    x16, wide = x.bfloat16(), torch.randn(5, 40).bfloat16()
    before = wide.clone()
    assert add_lora_cpu(native, wide[:, 8:24], x16, slots, a16, b16, scales, ranks)
    expected = before[:, 8:24].float()
    assert add_lora_cpu(native, expected, x16.float(), slots, a16, b16, scales, ranks)
    assert torch.equal(wide[:, 8:24], expected.bfloat16())
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 24:], before[:, 24:])
    assert torch.equal(wide[1, 8:24], before[1, 8:24])  # no adapter: untouched
