"""A stack of decoder layers as one native call (``tgi_paged_kernels.cpu_layer_stack.LayerStack``) against the same
layers one :func:`~tgi_paged_kernels.cpu_layer.decode_layer` call each: the output and every layer's K/V equal to
the bit (the same kernel per layer, in the same order), in fp32 and bf16; inputs of another kind give ``None``
(the caller's per-layer path); a bad slot names the layer."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_cpu_layer import FORMS, _layer, _step
from tgi_paged_kernels.cpu_layer import decode_layer
from tgi_paged_kernels.cpu_layer_stack import LayerStack

LAYERS = 3


def _stack_case(form_name: str, dtype: torch.dtype = torch.float32):
    hq, hkv, d, form = FORMS[form_name]
    hidden, inter, block_size = 64, 96, 4
    weights = [_layer(hq, hkv, d, hidden, inter, form, seed=i)[1] for i in range(LAYERS)]
    if dtype == torch.bfloat16:
        weights = [w.as_bf16() for w in weights]
    lengths = [1, 5, 17, 9]
    steps = [_step(lengths, block_size, hkv, d, torch.int64, seed=i) for i in range(LAYERS)]
    pools = [tuple(p.to(dtype) for p in s[0]) for s in steps]
    _, tables, seq_lens, slots = steps[0]  # one table for every layer; each layer its own pools' history
    g = torch.Generator().manual_seed(3)
    x = torch.randn(len(lengths), hidden, generator=g).to(dtype)
    r = form.rotary_dim or d
    cos, sin = (torch.randn(len(lengths), r, generator=g).to(dtype) for _ in range(2))
    return weights, pools, tables, seq_lens, slots, x, cos, sin


@pytest.mark.parametrize(
    ("form_name", "dtype"),
    [("Llama", torch.float32), ("Qwen3", torch.float32), ("Gemma3", torch.float32), ("Mixtral", torch.float32),
     ("Phi", torch.float32), ("Llama", torch.bfloat16), ("Qwen3", torch.bfloat16)],
)  # fmt: skip
def test_the_stack_equals_one_call_per_layer(native, form_name, dtype) -> None:
    weights, pools, tables, seq_lens, slots, x, cos, sin = _stack_case(form_name, dtype)
    one_by_one = [(k.clone(), v.clone()) for k, v in pools]
    expected = x
    for w, (k, v) in zip(weights, one_by_one):
        expected = decode_layer(native, w, expected, cos, sin, k, v, slots, tables, seq_lens)
        assert expected is not None
    stacked = [(k.clone(), v.clone()) for k, v in pools]
    got = LayerStack(native, weights).decode(
        x, cos, sin, [k for k, _ in stacked], [v for _, v in stacked], slots, [tables] * LAYERS, seq_lens
    )
    assert got is not None and got.dtype == dtype
    assert torch.equal(got, expected)
    for (k1, v1), (k2, v2) in zip(one_by_one, stacked):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert not torch.equal(got, x)


def test_each_layer_its_own_slots_and_table(native) -> None:
    """KV layer groups: each layer writes its group's slots and reads its group's table (here every layer its own
    blocks), as one call per layer with those does; a slot list of another length or dtype gives ``None``."""
    weights, pools, _, seq_lens, _, x, cos, sin = _stack_case("Gemma3")
    hq, hkv, d, _ = FORMS["Gemma3"]
    lengths = [1, 5, 17, 9]
    groups = [_step(lengths, 4, hkv, d, torch.int64, seed=10 + i) for i in range(LAYERS)]  # shuffled block ids
    slots, tables = [g[3] for g in groups], [g[1] for g in groups]
    assert not torch.equal(slots[0], slots[1])
    one_by_one = [(k.clone(), v.clone()) for k, v in pools]
    expected = x
    for w, (k, v), s, t in zip(weights, one_by_one, slots, tables):
        expected = decode_layer(native, w, expected, cos, sin, k, v, s, t, seq_lens)
        assert expected is not None
    stacked = [(k.clone(), v.clone()) for k, v in pools]
    ks, vs = [k for k, _ in stacked], [v for _, v in stacked]
    got = LayerStack(native, weights).decode(x, cos, sin, ks, vs, slots, tables, seq_lens)
    assert got is not None and torch.equal(got, expected)
    for (k1, v1), (k2, v2) in zip(one_by_one, stacked):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    stack = LayerStack(native, weights)
    assert stack.decode(x, cos, sin, ks, vs, slots[:2], tables, seq_lens) is None
    assert stack.decode(x, cos, sin, ks, vs, [s.int() for s in slots], tables, seq_lens) is None


def test_inputs_of_another_kind_give_none(native) -> None:
    weights, pools, tables, seq_lens, slots, x, cos, sin = _stack_case("Llama")
    stack = LayerStack(native, weights)
    ks, vs = [k for k, _ in pools], [v for _, v in pools]
    assert stack.decode(x, cos, sin, ks[:2], vs[:2], slots, [tables] * 2, seq_lens) is None  # a layer short
    wide = torch.cat([tables, tables], dim=1)
    assert stack.decode(x, cos, sin, ks, vs, slots, [tables, wide, tables], seq_lens) is None  # tables differ
    smaller = [ks[0], ks[1][:-1], ks[2]]
    assert stack.decode(x, cos, sin, smaller, vs, slots, [tables] * LAYERS, seq_lens) is None  # pools differ
    assert stack.decode(x, cos[:, :2], sin[:, :2], ks, vs, slots, [tables] * LAYERS, seq_lens) is None  # RoPE


def test_layers_of_another_geometry_are_refused(native) -> None:
    hq, hkv, d, form = FORMS["Llama"]
    a = _layer(hq, hkv, d, 64, 96, form)[1]
    b = _layer(hq, 2, d, 64, 96, form)[1]
    with pytest.raises(ValueError, match="differ"):
        LayerStack(native, [a, b])


def test_a_slot_outside_the_pool_names_the_layer(native) -> None:
    weights, pools, tables, seq_lens, slots, x, cos, sin = _stack_case("Llama")
    bad = slots.clone()
    bad[1] = pools[0][0].shape[0] * pools[0][0].shape[1] + 3
    with pytest.raises(ValueError, match=r"layer 0\).*outside the pool"):
        LayerStack(native, weights).decode(
            x, cos, sin, [k for k, _ in pools], [v for _, v in pools], bad, [tables] * LAYERS, seq_lens
        )


def test_lora_rows_in_the_stack_equal_one_call_per_layer(native) -> None:
    """Each layer adds its own adapters' deltas to the rows whose slot is an adapter, as one call per layer does."""
    from tests.kernels.test_cpu_layer_lora import HIDDEN, INTER, _lora

    hq, hkv, d, form = FORMS["Llama"]
    weights = [_layer(hq, hkv, d, HIDDEN, INTER, form, seed=i)[1] for i in range(LAYERS)]
    loras = [_lora(hq, hkv, d, form.gated) for _ in range(LAYERS)]
    lengths = [1, 5, 17, 9]
    (k0, v0), tables, seq_lens, slots = _step(lengths, 4, hkv, d, torch.int64)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(lengths), HIDDEN, generator=g)
    cos, sin = (torch.randn(len(lengths), d, generator=g) for _ in range(2))
    token_slots = torch.tensor([0, -1, 2, 1])
    one = [(k0.clone(), v0.clone()) for _ in range(LAYERS)]
    expected = x
    for w, lora, (k, v) in zip(weights, loras, one):
        expected = decode_layer(native, w, expected, cos, sin, k, v, slots, tables, seq_lens, None, lora, token_slots)
    stacked = [(k0.clone(), v0.clone()) for _ in range(LAYERS)]
    got = LayerStack(native, weights).decode(
        x, cos, sin, [k for k, _ in stacked], [v for _, v in stacked], slots, [tables] * LAYERS, seq_lens, loras,
        token_slots,
    )  # fmt: skip
    assert got is not None and torch.equal(got, expected)
    for (k1, v1), (k2, v2) in zip(one, stacked):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    base = LayerStack(native, weights).decode(
        x, cos, sin, [k0.clone()] * LAYERS, [v0.clone()] * LAYERS, slots, [tables] * LAYERS, seq_lens
    )
    assert base is not None and not torch.equal(base, got)  # the deltas count


def test_verify_rows_in_the_stack_equal_one_call_per_layer(native) -> None:
    """A speculative verify step (several rows per request over earlier context) through the stack: each layer as
    one ``decode_layer`` call with the same ``query_start_loc`` gives it."""
    from tests.kernels.test_cpu_layer_lora import _verify_step

    hq, hkv, d, form = FORMS["Qwen3"]
    weights = [_layer(hq, hkv, d, 64, 96, form, seed=i)[1] for i in range(LAYERS)]
    (k0, v0), tables, seq_lens, slots, qsl = _verify_step([3, 1, 4], [5, 9, 2], 4, hkv, d)
    g = torch.Generator().manual_seed(6)
    rows = int(qsl[-1])
    x = torch.randn(rows, 64, generator=g)
    cos, sin = (torch.randn(rows, d, generator=g) for _ in range(2))
    one = [(k0.clone(), v0.clone()) for _ in range(LAYERS)]
    expected = x
    for w, (k, v) in zip(weights, one):
        expected = decode_layer(native, w, expected, cos, sin, k, v, slots, tables, seq_lens, qsl)
    stacked = [(k0.clone(), v0.clone()) for _ in range(LAYERS)]
    got = LayerStack(native, weights).decode(
        x, cos, sin, [k for k, _ in stacked], [v for _, v in stacked], slots, [tables] * LAYERS, seq_lens,
        query_start_loc=qsl,
    )  # fmt: skip
    assert got is not None and torch.equal(got, expected)
    for (k1, v1), (k2, v2) in zip(one, stacked):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
