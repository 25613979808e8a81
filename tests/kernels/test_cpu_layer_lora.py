"""The native decode layer's step features against the torch reference: LoRA deltas inside the call (rows of
several adapters of different ranks mixed with base rows, q/k/v and gate/up as column ranges of the fused GEMMs,
o and down; sequential, sandwich and parallel forms) and speculative verify steps (several query rows per request,
causal over the request's new tokens), alone and together; the same bits on one or two threads; an AVX2 build;
the errors on slots or query offsets that do not fit."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from tests.kernels.test_cpu_layer import FORMS, _layer
from tgi_paged_kernels.cpu_layer import decode_layer
from tgi_paged_kernels.cpu_layer_lora import LayerLora, LoraTarget
from tgi_paged_kernels.cpu_layer_ref import decode_layer_ref
from tgi_paged_kernels.cpu_lora import cpu_b_stack
from tgi_paged_kernels.cpu_native import FLAGS, SOURCES, NativeKernels

HIDDEN, INTER = 96, 160
SLOT_RANKS = ((4, 0, 8), (2, 6, 0), (8, 8, 3))
"""Per target kind, the rank of each of three adapter slots (0: the adapter leaves it out): ranks differ."""


def _target(projection: str, column: int, width: int, in_features: int, ranks: tuple[int, ...], seed: int):
    g = torch.Generator().manual_seed(seed)
    max_rank = max(ranks)
    a = torch.zeros(len(ranks), max_rank, in_features)
    b = cpu_b_stack(len(ranks), width, max_rank, torch.float32)
    for slot, rank in enumerate(ranks):
        a[slot, :rank] = torch.randn(rank, in_features, generator=g) / in_features**0.5
        b[slot, :, :rank] = torch.randn(width, rank, generator=g) * 0.3
    scales = torch.tensor([2.0, 0.5, 1.25])[: len(ranks)]
    return LoraTarget(projection, column, a, b, scales, torch.tensor(ranks, dtype=torch.int32))


def _lora(hq: int, hkv: int, d: int, gated: bool, targets: str = "all") -> LayerLora:
    """q, k, v on their columns of the fused q/k/v; o; gate and up (or the ungated up); down."""
    q, kv = hq * d, hkv * d
    made = [
        _target("qkv", 0, q, HIDDEN, SLOT_RANKS[0], 1),
        _target("qkv", q, kv, HIDDEN, SLOT_RANKS[1], 2),
        _target("qkv", q + kv, kv, HIDDEN, SLOT_RANKS[2], 3),
        _target("o", 0, HIDDEN, q, SLOT_RANKS[1], 4),
        _target("gate_up", 0, INTER, HIDDEN, SLOT_RANKS[2], 5),
        _target("down", 0, HIDDEN, INTER, SLOT_RANKS[0], 7),
    ]
    if gated:
        made.append(_target("gate_up", INTER, INTER, HIDDEN, SLOT_RANKS[0], 6))
    if targets == "qv":  # only some projections
        made = [made[0], made[2]]
    return LayerLora(made)


def _verify_step(q_lens: list[int], contexts: list[int], block_size: int, hkv: int, d: int, seed: int = 0):
    """Pools with random history and block tables (scattered blocks) for requests with ``contexts[b]`` positions
    before this step and ``q_lens[b]`` new rows; the rows' slots and query_start_loc."""
    g = torch.Generator().manual_seed(seed)
    lengths = [c + q for c, q in zip(contexts, q_lens)]
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = len(lengths) * width + 1
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = order[: len(lengths) * width].view(len(lengths), width).to(torch.int32)
    pools = [torch.randn(num_blocks, block_size, hkv, d, generator=g) for _ in range(2)]
    slots = [
        int(tables[b, p // block_size]) * block_size + p % block_size
        for b, (c, n) in enumerate(zip(contexts, lengths))
        for p in range(c, n)
    ]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return pools, tables, torch.tensor(lengths, dtype=torch.int32), torch.tensor(slots), qsl


def _run(native, form_name, q_lens, contexts, token_slots, lora_on=True, threads=1, block_size=4, targets="all"):
    hq, hkv, d, form = FORMS[form_name]
    raw, packed = _layer(hq, hkv, d, HIDDEN, INTER, form)
    (k_pool, v_pool), tables, seq_lens, slots, qsl = _verify_step(q_lens, contexts, block_size, hkv, d)
    tokens = int(qsl[-1])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, HIDDEN, generator=g)
    r = form.rotary_dim or d
    cos, sin = torch.randn(tokens, r, generator=g), torch.randn(tokens, r, generator=g)
    if form.rope == "none":
        cos = sin = None
    lora = _lora(hq, hkv, d, form.gated, targets) if lora_on else None
    slots_t = torch.tensor(token_slots, dtype=torch.int64) if lora_on else None
    multi = None if all(q == 1 for q in q_lens) else qsl
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_layer(native, packed, x, cos, sin, k_pool, v_pool, slots, tables, seq_lens, multi, lora, slots_t)
    finally:
        torch.set_num_threads(previous)
    expected = decode_layer_ref(
        raw, packed, x, cos, sin, ref_k, ref_v, slots, tables, seq_lens, multi, lora, slots_t
    )  # fmt: skip
    return got, expected, (k_pool, v_pool, ref_k, ref_v)


@pytest.mark.parametrize(
    "form_name",
    ["SmolLM2", "Mistral+Qwen2", "Gemma3", "Granite", "Cohere", "Phi", "OPT post-LN", "Falcon"],
)  # sequential, sandwich and post-LN norms, residual scale, parallel blocks (o's delta straight onto h), ungated
def test_lora_rows_match_the_reference(native, form_name) -> None:
    token_slots = [-1, 0, 2, 1, -1, 0, 2, 2]  # adapters mixed with base rows, one adapter twice apart
    got, expected, (k, v, ref_k, ref_v) = _run(native, form_name, [1] * 8, [4, 0, 16, 39, 2, 7, 30, 11], token_slots)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k, ref_k, rtol=1e-4, atol=1e-4)  # the k delta reaches the pool
    torch.testing.assert_close(v, ref_v, rtol=1e-4, atol=1e-4)
    base, _, _ = _run(native, form_name, [1] * 8, [4, 0, 16, 39, 2, 7, 30, 11], token_slots, lora_on=False)
    moved = (got - base).abs().amax(dim=1) > 1e-3
    assert moved.tolist() == [s >= 0 for s in token_slots]  # every adapter row changed, no base row did


def test_many_rows_of_one_adapter(native) -> None:
    """Rows of one adapter beyond a group of 8 (the kernel reads an adapter's A and B once per group of rows)."""
    token_slots = [1] * 11 + [-1, 0, 1, 1, -1, 2] + [1] * 3
    contexts = [3 + 2 * i for i in range(len(token_slots))]
    got, expected, _ = _run(native, "SmolLM2", [1] * len(token_slots), contexts, token_slots)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    base, _, _ = _run(native, "SmolLM2", [1] * len(token_slots), contexts, token_slots, lora_on=False)
    assert ((got - base).abs().amax(dim=1) > 1e-3).tolist() == [s >= 0 for s in token_slots]


@pytest.mark.parametrize("counts", [(1, 2, 3), (4, 5, 6), (7, 8, 15)])
def test_groups_of_every_size(native, counts) -> None:
    """Each adapter's rows run in groups of up to 8, each size its own register tile (1 to 8 rows; 15 rows: a
    group of 8 and one of 7), interleaved with base rows, on two threads."""
    token_slots = []
    for i in range(max(counts)):
        token_slots += [slot for slot, n in enumerate(counts) if i < n] + ([-1] if i % 3 == 0 else [])
    contexts = [2 + (5 * i) % 23 for i in range(len(token_slots))]
    got, expected, _ = _run(native, "SmolLM2", [1] * len(token_slots), contexts, token_slots, threads=2)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    one, _, _ = _run(native, "SmolLM2", [1] * len(token_slots), contexts, token_slots)
    assert torch.equal(got, one)


def test_lora_rows_are_the_same_with_two_threads(native) -> None:
    token_slots = [2, -1, 0, 1, 1, 0]
    one, _, _ = _run(native, "SmolLM2", [1] * 6, [3, 8, 20, 1, 5, 9], token_slots)
    two, _, _ = _run(native, "SmolLM2", [1] * 6, [3, 8, 20, 1, 5, 9], token_slots, threads=2)
    assert torch.equal(one, two)


def test_lora_on_some_projections_and_int64_slots_only(native) -> None:
    hq, hkv, d, _ = FORMS["SmolLM2"]
    lora = _lora(hq, hkv, d, True, targets="qv")
    slots = torch.tensor([0, -1, 1])
    assert lora.args(slots) is not None and lora.args(slots.int()) is None
    got, expected, _ = _run(native, "SmolLM2", [1] * 3, [3, 5, 7], [0, -1, 2], targets="qv")
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form_name", ["SmolLM2", "Mistral+Qwen2", "Gemma3", "Cohere", "Qwen3-MoE"])
def test_verify_rows_match_the_reference(native, form_name) -> None:
    """Several query rows per request (a verify step: last token + draft), mixed with one-row requests; the
    window of Mistral's and Gemma 3's forms cuts a row's view at its own position."""
    got, expected, (k, v, ref_k, ref_v) = _run(native, form_name, [3, 1, 5, 2], [9, 14, 4, 30], [], lora_on=False)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k, ref_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, ref_v, rtol=1e-4, atol=1e-4)


def test_a_verify_row_sees_its_own_and_earlier_positions_only(native) -> None:
    """Causal within the request: a request's first rows give the same output whatever draft follows them."""
    hq, hkv, d, form = FORMS["SmolLM2"]
    raw, packed = _layer(hq, hkv, d, HIDDEN, INTER, form)
    (k_pool, v_pool), tables, seq_lens, slots, qsl = _verify_step([4], [10], 4, hkv, d)
    x, cs = torch.randn(4, HIDDEN), torch.randn(4, d)
    full = decode_layer(native, packed, x, cs, cs, k_pool.clone(), v_pool.clone(), slots, tables, seq_lens, qsl)
    other = x.clone()
    other[3] += 1.0  # a different last draft token
    changed = decode_layer(native, packed, other, cs, cs, k_pool.clone(), v_pool.clone(), slots, tables, seq_lens, qsl)
    assert full is not None and changed is not None
    assert torch.equal(full[:3], changed[:3]) and not torch.allclose(full[3], changed[3])


def test_lora_and_verify_rows_together(native) -> None:
    q_lens = [2, 4, 1]
    token_slots = [1, 1, -1, -1, -1, -1, 2]  # a request's rows share its adapter
    got, expected, _ = _run(native, "SmolLM2", q_lens, [6, 17, 3], token_slots)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_slots_and_offsets_that_do_not_fit_are_refused(native) -> None:
    hq, hkv, d, form = FORMS["SmolLM2"]
    raw, packed = _layer(hq, hkv, d, HIDDEN, INTER, form)
    (k_pool, v_pool), tables, seq_lens, slots, qsl = _verify_step([2, 1], [5, 3], 4, hkv, d)
    x, cs, lora = torch.randn(3, HIDDEN), torch.randn(3, d), _lora(hq, hkv, d, True)
    args = (native, packed, x, cs, cs, k_pool, v_pool, slots, tables, seq_lens)
    with pytest.raises(ValueError, match="LoRA slots"):  # slot 3 of 3 adapters
        decode_layer(*args, qsl, lora, torch.tensor([0, 3, -1]))
    with pytest.raises(ValueError, match="query_start_loc"):  # offsets that do not cover the 3 rows
        decode_layer(*args, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="query_start_loc"):  # a row that would see no position
        decode_layer(*args[:-1], torch.tensor([1, 4], dtype=torch.int32), qsl)
    assert decode_layer(*args, qsl, lora, torch.tensor([0, 1, -1], dtype=torch.int32)) is None  # int64 slots only
    assert decode_layer(*args, qsl, lora, None) is None
    wrong = _target("down", 0, HIDDEN, HIDDEN, (2, 2, 2), 1)  # down reads the intermediate width, not hidden
    with pytest.raises(ValueError, match="LoRA slots"):
        decode_layer(*args, qsl, LayerLora([wrong]), torch.tensor([0, 1, -1]))


def test_the_avx2_build_gives_the_reference(native, tmp_path) -> None:
    """The LoRA tiles are GCC vector code: built for x86-64-v3 (AVX2, as CI hosts) they run as two 256-bit halves
    and still give the reference."""
    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler is not None  # the native fixture built the library with it
    library = tmp_path / "cpu_kernels_v3.so"
    flags = [f if f != "-march=native" else "-march=x86-64-v3" for f in FLAGS]
    done = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(library)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    v3 = NativeKernels(library)
    token_slots = [1] * 9 + [-1, 0, 2]
    got, expected, _ = _run(v3, "SmolLM2", [2] * 6, [5 + 3 * i for i in range(6)], token_slots)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _stacks_in(lora: LayerLora, dtype: torch.dtype) -> LayerLora:
    """``lora``'s targets with A and B rounded to bf16, stored in ``dtype`` (bf16, or fp32 holding those values)."""

    def cast(t: LoraTarget) -> LoraTarget:
        a = t.a_stack.to(torch.bfloat16).to(dtype)
        num_slots, max_rank, _ = t.a_stack.shape
        b = cpu_b_stack(num_slots, t.b_stack.shape[1], max_rank, dtype).transpose(1, 2)  # [S, R, N]
        b.copy_(t.b_stack.transpose(1, 2).to(torch.bfloat16))
        return LoraTarget(t.projection, t.column, a, b.transpose(1, 2), t.scales, t.ranks)

    return LayerLora([cast(t) for t in lora.targets])


@pytest.mark.parametrize("native_build", ["native", "x86-64-v3", "x86-64"])
def test_bf16_stacks_give_the_bits_of_fp32_stacks_of_their_values(native, tmp_path, native_build) -> None:
    """An fp32 model's adapters saved in bf16 stay bf16 (half the bytes): the tiles widen each value exactly, so the
    layer's output and K/V are those of fp32 stacks holding the same values, bit for bit, on every build."""
    kernels = native
    if native_build != "native":
        if native_build == "x86-64-v3" and "avx2" not in open("/proc/cpuinfo").read():
            pytest.skip("this CPU cannot run AVX2 code")
        compiler = shutil.which("c++") or shutil.which("g++")
        assert compiler is not None
        library = tmp_path / f"cpu_kernels_{native_build}.so"
        flags = [f if f != "-march=native" else f"-march={native_build}" for f in FLAGS]
        done = subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(library)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        kernels = NativeKernels(library)
    hq, hkv, d, form = FORMS["SmolLM2"]
    _, packed = _layer(hq, hkv, d, HIDDEN, INTER, form)
    (k_pool, v_pool), tables, seq_lens, slots, _ = _verify_step([1] * 10, [3 + 5 * i for i in range(10)], 4, hkv, d)
    g = torch.Generator().manual_seed(8)
    x, cos, sin = torch.randn(10, HIDDEN, generator=g), torch.randn(10, d, generator=g), torch.randn(10, d, generator=g)
    token_slots = torch.tensor([0, 1, 2, -1, 1, 1, 0, 2, 2, -1])
    outs = []
    for dtype in (torch.bfloat16, torch.float32):
        lora = _stacks_in(_lora(hq, hkv, d, form.gated), dtype)
        assert all(t.a_stack.dtype == dtype for t in lora.targets)
        k, v = k_pool.clone(), v_pool.clone()
        out = decode_layer(kernels, packed, x, cos, sin, k, v, slots, tables, seq_lens, None, lora, token_slots)
        assert out is not None
        outs.append((out, k, v))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
