"""The load-time block fusion (``runner.cpu.fused_blocks``): which families get one q/k/v GEMM, one RoPE pass and
one gate/up GEMM, that a block whose forward differs is kept (the numeric check at load), and that fused
runners give the logits of unfused ones. (Token-exactness of every family against HF: test_family_matrix.)"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.family_models import FAMILIES
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.cpu import fused_blocks
from tgi_paged_backend.runner.cpu.fused_blocks import FusedGatedMLP, FusedPagedAttention
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.rewrites.base import ModelRewrite
from tgi_paged_backend.runner.rewrites.pipeline import model_rewrites

BY_NAME = {family.name: family for family in FAMILIES}

EXPECTED = {
    # family: (fused attentions, fused MLPs) of its 2 layers
    "Llama": (2, 2),
    "Llama-3.1": (2, 2),
    "Mistral": (2, 2),
    "Qwen2": (2, 2),  # q/k/v biases
    "Qwen3": (2, 2),  # per-head q/k norms
    "Granite": (2, 2),  # attention multiplier as the scale
    "Gemma": (2, 2),  # GeGLU MLP
    "Gemma2": (2, 2),  # the attention's soft-cap carried
    "Gemma3": (2, 2),  # q/k norms of the 1 + w kind
    "OLMo2": (2, 2),  # q/k norms over all heads
    "Cohere": (2, 2),  # interleaved RoPE (ROPE_TRIES)
    "Cohere2": (2, 2),  # interleaved RoPE on the sliding layer, none on the full one
    "GPT-NeoX": (2, 0),  # query_key_value's per-head rows reordered; its MLP is not gated
    "GPT-J": (2, 0),  # GPT-J's (sin, cos) half-width tables, interleaved pairs
    "StarCoder2": (2, 0),  # biases everywhere; its MLP is not gated
    "Phi": (2, 0),  # partial rotary, `dense` as o_proj; its MLP is not gated
    "Phi3": (2, 2),  # q/k/v and gate/up already one projection each in the checkpoint: taken as they are
    "Mixtral": (2, 0),  # experts are not a gated MLP module of plain linears
    "Qwen2-MoE": (2, 2),  # the shared expert of each layer is a gated MLP
    "Qwen3-MoE": (2, 0),
    "GPT-BigCode": (2, 0),  # multi-query c_attn taken as it is; no RoPE
    "GPT-2": (2, 0),  # Conv1D c_attn linearized at load
    "OPT": (2, 0),  # the query's own scaling folded into the softmax scale (QUERY_SCALED)
    "Falcon": (2, 0),  # our Falcon attention: q/k/v rows per KV group reordered
    "Falcon-7B": (2, 0),  # multi-query
    "Falcon-RW": (0, 0),  # ALiBi: not one plain paged call
}


def _runner(path, rewrites: tuple[ModelRewrite, ...] | None = None) -> ModelRunner:
    return ModelRunner(ModelConfig(model_id=str(path)), CacheConfig(block_size=4), rewrites=rewrites)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_which_blocks_fuse(family_dir, name) -> None:
    runner = _runner(family_dir(name))
    attentions, mlps = EXPECTED[name]
    assert runner.fusion is not None
    assert (runner.fusion.attentions, runner.fusion.mlps) == (attentions, mlps)
    kinds = [type(m) for m in runner.model.modules()]
    assert kinds.count(FusedPagedAttention) == attentions and kinds.count(FusedGatedMLP) == mlps


def test_an_attention_that_differs_is_kept(family_dir, monkeypatch) -> None:
    """Cohere's interleaved RoPE taken for neox by mistake: the load-time check refuses it."""
    monkeypatch.setattr(fused_blocks, "ROPE_TRIES", {})
    runner = _runner(family_dir("Cohere"))
    assert runner.fusion is not None and runner.fusion.attentions == 0
    assert "CohereAttention" in runner.fusion.kept


@pytest.mark.parametrize(
    "name", ["Llama", "Qwen3", "Mistral", "Cohere2", "GPT-NeoX", "GPT-J", "Phi", "GPT-2", "OPT", "Falcon", "Falcon-7B"]
)
def test_fused_runners_give_the_logits_of_unfused_ones(family_dir, name) -> None:
    path = family_dir(name)
    fused = _runner(path)
    plain = _runner(path, rewrites=model_rewrites(without=("fuse",)))
    assert not any(isinstance(m, FusedPagedAttention | FusedGatedMLP) for m in plain.model.modules())
    prompts = [[3, 17, 5, 9, 11, 2, 8, 13, 21, 4, 6], [7, 7, 1, 30, 2]]
    blocks = 8
    for runner in (fused, plain):
        runner.allocate_kv_cache(2 * blocks + 1)
    logits = []
    for runner in (fused, plain):
        chunks = [RequestChunk(p, 0, list(range(1 + i * blocks, 1 + (i + 1) * blocks))) for i, p in enumerate(prompts)]
        prefill = runner.forward(build_forward_batch(chunks, 4))
        chunks = [RequestChunk([5], len(p), c.block_table) for p, c in zip(prompts, chunks)]
        decode = runner.forward(build_forward_batch(chunks, 4))
        logits.append((prefill, decode))
    for got, expected in zip(logits[0], logits[1]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_fused_attention_takes_the_options_its_original_passes(family_dir) -> None:
    """The window and scale come from what the original forward hands to the attention function."""
    windows = {
        name: {
            m.sliding_window for m in _runner(family_dir(name)).model.modules() if isinstance(m, FusedPagedAttention)
        }
        for name in ("Llama", "Mistral")
    }
    assert windows == {"Llama": {None}, "Mistral": {BY_NAME["Mistral"].overrides["sliding_window"]}}
    granite = _runner(family_dir("Granite"))
    multiplier = granite.model.config.attention_multiplier
    assert {m.scaling for m in granite.model.modules() if isinstance(m, FusedPagedAttention)} == {multiplier}


def test_an_attention_whose_forward_fails_the_check_is_kept(family_dir, monkeypatch) -> None:
    """Any error in the check (an attention of another signature) keeps the original, with no load failure."""
    original = fused_blocks.FusedPagedAttention.__init__

    def broken(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise TypeError("another signature")

    monkeypatch.setattr(fused_blocks.FusedPagedAttention, "__init__", broken)
    runner = _runner(family_dir("Llama"))
    assert runner.fusion is not None and runner.fusion.attentions == 0 and "LlamaAttention" in runner.fusion.kept
