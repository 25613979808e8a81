"""A stacked model's decode steps without transformers' model loop (``runner.native.direct``): proven at Warmup against
the model's forward, then serving decode steps with its logits to the bit, the scalings some families add around
their layers included (Granite's multipliers, Cohere's logit scale, Gemma 2's final soft-cap); a direct step that
leaves one out, or differs by a bit, is kept on the model's forward, and says why."""

from __future__ import annotations

import pytest
import torch

from tests.runner.test_native_layers import _runner, _steps
from tests.runner.test_native_stack import NEW_TOKENS, PROMPTS
from tgi_paged_backend.runner.native import direct as native_direct
from tgi_paged_backend.runner.native.direct import DirectDecode, Ends
from tgi_paged_kernels.cpu_native import native_kernels

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="no C++ compiler here: no native kernels")

DIRECT = {
    **dict.fromkeys(
        [
            "Llama",
            "Mistral",
            "Qwen2",
            "Qwen3",
            "Gemma",
            "OLMo2",
            "Phi3",
            "StarCoder2",
            "Mixtral",
            "Qwen2-MoE",
            "Qwen3-MoE",
        ],
        "",
    ),  # fmt: skip
    "Cohere": "",  # its logits are scaled after the head
    "Granite": "",  # embedding and logits multipliers (the residual one is the layers')
    "Gemma2": "",  # final logit soft-capping
    "Gemma3": "kept: not stacked",  # local and global RoPE tables: no stack
    "GPT-2": "none",  # transformer.h, not model.layers
    "Falcon": "none",
}
"""What each tiny family's direct decode does after Warmup: serves (""), is kept (``kept: `` a word of the reason),
or the model's modules are not laid out for one (``none``)."""


@pytest.mark.parametrize("name", sorted(DIRECT))
def test_direct_decode_serves_where_proven_with_the_models_logits(family_dir, name) -> None:
    runner = _runner(family_dir(name))
    runner.allocate_kv_cache(8)
    runner.warm_decode()
    direct = runner.direct_decode
    outcome, _, reason = DIRECT[name].partition(": ")
    if outcome == "none":
        assert direct is None
        return
    assert direct is not None and direct.enabled == (outcome == "") and reason in direct.kept
    steps = direct.steps
    served = _steps(runner, PROMPTS, NEW_TOKENS)
    assert direct.steps - steps == (NEW_TOKENS if direct.enabled else 0)  # decode steps; the prefill is the model's
    through_model = _steps(_runner(family_dir(name)), PROMPTS, NEW_TOKENS)  # not warmed: nothing proven
    for got, expected in zip(served, through_model):
        assert torch.equal(got, expected)


def test_a_direct_step_that_differs_is_not_served(family_dir, monkeypatch) -> None:
    """The proof compares the logits to the bit: a direct step whose head is off by a bit never serves."""
    real = DirectDecode.run

    def off_by_a_bit(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        return None if out is None else out * 1.001

    monkeypatch.setattr(DirectDecode, "run", off_by_a_bit)
    runner = _runner(family_dir("Llama"))
    runner.allocate_kv_cache(8)
    runner.warm_decode()
    direct = runner.direct_decode
    assert direct is not None and not direct.enabled and "differ" in direct.kept
    assert runner.native_layers.stacks[0].enabled  # the stack still serves, through the model's forward
    steps = direct.steps
    _steps(runner, PROMPTS, 2)
    assert direct.steps == steps


def test_a_model_whose_layers_are_not_the_stack_has_no_direct_step(family_dir) -> None:
    runner = _runner(family_dir("Llama"))
    layers = runner.model.model.layers
    runner.model.model.layers = type(layers)(list(layers)[:1])  # the loop now calls only the first layer
    runner.allocate_kv_cache(8)
    runner.warm_decode()
    assert runner.direct_decode is None


@pytest.mark.parametrize("name", ["Cohere", "Granite", "Gemma2"])
def test_a_direct_step_without_the_familys_scalings_is_not_served(family_dir, monkeypatch, name) -> None:
    """The scalings are read from the model (:class:`Ends`); a direct step that left them out would give other
    logits: the proof catches it."""
    runner = _runner(family_dir(name))
    assert Ends.of(runner.model) != Ends()
    monkeypatch.setattr(native_direct.Ends, "of", classmethod(lambda cls, model: cls()))
    runner = _runner(family_dir(name))
    runner.allocate_kv_cache(8)
    runner.warm_decode()
    direct = runner.direct_decode
    assert direct is not None and not direct.enabled and "differ" in direct.kept
