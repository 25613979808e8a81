"""A model's native layers as one call per decode step (``runner.native.stack``): proven at Warmup on scratch
pools, then serving decode steps with the per-layer path's logits to the bit; models whose layers take different
RoPE tables, differ in rotary kind, or are not all native keep a call per layer, and say why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.runner.test_native_layers import _runner, _steps
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.native import stack as native_stack
from tgi_paged_backend.runner.native.layers import NativeDecoderLayer
from tgi_paged_kernels.cpu_native import native_kernels

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="no C++ compiler here: no native kernels")

PROMPTS = [[3, 17, 5, 9, 11, 2, 8, 13, 21, 4, 6], [7, 7, 1, 30, 2], [12]]
NEW_TOKENS = 6

STACKED = {
    **dict.fromkeys(
        [
            "Llama",
            "Mistral",
            "Qwen2",
            "Qwen3",
            "Gemma",
            "Granite",
            "OLMo2",
            "Mixtral",
            "Qwen3-MoE",
            "Qwen2-MoE",
            "Phi",
            "Phi3",
            "Cohere",
            "StarCoder2",
            "GPT-J",
            "GPT-NeoX",
            "GPT-BigCode",
            "OPT",
            "Falcon-7B",
        ],
        "",
    ),  # fmt: skip
    "Gemma2": "",  # a sliding and a full layer: one RoPE table, windows in the layers' specs
    "GPT-2": "",  # no RoPE: no tables at all
    "Falcon": "",  # its layers take their metadata from the attention's channel
    "Gemma3": "kept: different RoPE tables",  # local and global tables
    "Cohere2": "none: differ in KV heads, head size, hidden size or rotary kind",  # a full layer without RoPE
    "gpt-oss": "none: ",  # no native layer at all (its MoE layers run per op)
}
"""What each tiny family's stack does after Warmup: serves (""), is kept (``kept: `` the reason), or there is none
(``none: `` why)."""


def _warmed(name: str, family_dir):
    runner = _runner(family_dir(name))
    runner.allocate_kv_cache(8)
    runner.warm_decode()
    return runner


@pytest.mark.parametrize("name", sorted(STACKED))
def test_the_stack_serves_where_proven_with_the_per_layer_logits(family_dir, name) -> None:
    runner = _warmed(name, family_dir)
    report = runner.native_layers
    assert report is not None
    outcome, _, reason = STACKED[name].partition(": ")
    if outcome == "none":
        assert report.stacks == () and (not reason or any(reason in line for line in report.stack_kept))
        return
    (stack,) = report.stacks
    assert stack.enabled == (outcome == "") and reason in stack.kept
    layers = [m for m in runner.model.modules() if isinstance(m, NativeDecoderLayer)]
    steps, calls = stack.steps, [layer.native_steps for layer in layers]
    stacked = _steps(runner, PROMPTS, NEW_TOKENS)
    assert stack.steps - steps == (NEW_TOKENS if stack.enabled else 0)
    assert [layer.native_steps - n for layer, n in zip(layers, calls)] == [NEW_TOKENS] * len(layers)
    per_layer = _steps(_runner(family_dir(name)), PROMPTS, NEW_TOKENS)  # not warmed: its stack is not proven
    for got, expected in zip(stacked, per_layer):
        assert torch.equal(got, expected)


def _grouped_steps(runner, warm: bool) -> tuple[list[torch.Tensor], int]:
    """:func:`_steps` over a pool laid out per KV layer group, each group's slots and tables on blocks of its own
    (as the engine pages them); Warmup first when ``warm``. Also the stacked steps served after Warmup."""
    groups, blocks = runner.kv_groups.num_groups, 8
    per_group_blocks = len(PROMPTS) * blocks
    runner.allocate_kv_cache(groups * per_group_blocks + 1, grouped=True)
    if warm:
        runner.warm_decode()
    stacks = runner.native_layers.stacks
    warm_steps = stacks[0].steps if stacks else 0

    def moved(chunk: RequestChunk, group: int) -> RequestChunk:
        return RequestChunk(
            chunk.token_ids, chunk.num_computed, [b + group * per_group_blocks for b in chunk.block_table]
        )

    def batch(chunks: list[RequestChunk]):
        per_group = [build_forward_batch([moved(c, g) for c in chunks], 4) for g in range(groups)]
        return dataclasses.replace(
            per_group[0],
            group_slot_mappings=tuple(b.slot_mapping for b in per_group[1:]),
            group_block_tables=tuple(b.block_tables for b in per_group[1:]),
        )

    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(len(PROMPTS))]
    logits = [runner.forward(batch([RequestChunk(p, 0, t) for p, t in zip(PROMPTS, tables)]))]
    lengths = [len(p) for p in PROMPTS]
    for _ in range(NEW_TOKENS):
        ids = logits[-1].argmax(dim=-1).tolist()
        logits.append(runner.forward(batch([RequestChunk([i], n, t) for i, n, t in zip(ids, lengths, tables)])))
        lengths = [n + 1 for n in lengths]
    return logits, (stacks[0].steps if stacks else 0) - warm_steps


@pytest.mark.parametrize("name", ["Gemma2", "Gemma3"])
def test_kv_layer_groups_stack_with_each_groups_slots(family_dir, name) -> None:
    """Sliding beside full layers, paged per KV layer group as the engine pages them: the stack gives each layer its
    group's slots and table in the one call (proven at Warmup on a step with a table per group), with the per-layer
    path's logits to the bit; Gemma 3's layers take local or global RoPE tables and keep a call per layer."""
    runner = _runner(family_dir(name))
    assert runner.kv_groups.num_groups == 2
    stacked, served = _grouped_steps(runner, warm=True)
    (stack,) = runner.native_layers.stacks
    if name == "Gemma3":
        assert not stack.enabled and "different RoPE tables" in stack.kept
        return
    assert stack.enabled, stack.kept
    assert served == NEW_TOKENS
    per_layer, _ = _grouped_steps(_runner(family_dir(name)), warm=False)
    for got, expected in zip(stacked, per_layer):
        assert torch.equal(got, expected)


def test_a_stacked_step_that_differs_is_not_served(family_dir, monkeypatch) -> None:
    """The proof compares the whole model's logits and K/V: a stack kernel off by a bit never serves."""
    real = native_stack.LayerStack.decode

    def off_by_a_bit(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        return None if out is None else out * 1.001

    monkeypatch.setattr(native_stack.LayerStack, "decode", off_by_a_bit)
    runner = _warmed("Llama", family_dir)
    (stack,) = runner.native_layers.stacks
    assert not stack.enabled and "differ" in stack.kept
    steps = stack.steps
    _steps(runner, PROMPTS, 2)
    assert stack.steps == steps


def test_a_model_that_skips_a_layer_is_not_stacked(family_dir) -> None:
    """The proof records the layers' calls: a loop that calls them other than once each, in order, keeps them."""
    runner = _runner(family_dir("Llama"))
    (stack,) = runner.native_layers.stacks
    layers = runner.model.model.layers
    runner.model.model.layers = type(layers)(list(layers)[:1])  # the loop now calls only the first layer
    runner.allocate_kv_cache(8)
    runner.warm_decode()
    assert not stack.enabled and "once, in order" in stack.kept


def test_tensor_parallel_layers_and_split_lora_routing_keep_a_call_each() -> None:
    class Layer:
        def __init__(self, all_reduce=None, lora_step=None):
            self._all_reduce, self.lora_step = all_reduce, lora_step

    assert "tensor-parallel" in native_stack.stack_layers([Layer(all_reduce=object())], lambda w: None)
    assert "route" in native_stack.stack_layers([Layer(), Layer(lora_step=object())], lambda w: None)


@pytest.mark.parametrize("name", ["Llama", "Qwen3-MoE"])
def test_verify_steps_run_stacked_with_the_per_layer_logits(family_dir, name) -> None:
    """Warmup proves a verify step too (the last token and drafts of each request): it then runs as one call, with
    the per-layer path's logits to the bit."""
    runner = _warmed(name, family_dir)
    (stack,) = runner.native_layers.stacks
    assert stack.enabled and stack.verify, stack.verify_kept

    def verify_logits(r) -> tuple[torch.Tensor, int]:
        r.allocate_kv_cache(16)
        tables = [[1, 2, 3], [4, 5, 6]]
        prefill = [RequestChunk([3, 17, 5, 9, 11], 0, tables[0]), RequestChunk([7, 7, 1], 0, tables[1])]
        r.forward(build_forward_batch(prefill, 4))
        steps = stack.steps
        verify = [
            RequestChunk([2, 8, 13], 5, tables[0], all_logits=True),
            RequestChunk([4, 6], 3, tables[1], all_logits=True),
        ]
        return r.forward(build_forward_batch(verify, 4)), stack.steps - steps

    got, served = verify_logits(runner)
    assert served == 1
    expected, _ = verify_logits(_runner(family_dir(name)))  # not warmed: a call per layer
    assert torch.equal(got, expected)
