"""Native decode layers (``runner.native.layers``): which families' layers run decode steps as one native call,
that those runners give the logits and greedy tokens of the per-op path, and that anything else keeps the
Python path. (Token-exactness of every family against HF: test_family_matrix, which serves them natively.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.cpu import layer_forms
from tgi_paged_backend.runner.cpu.fused_blocks import FusedPagedAttention
from tgi_paged_backend.runner.cpu.layer_forms import layer_attention
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.native import layers as native_layers
from tgi_paged_backend.runner.native.layers import NativeDecoderLayer
from tgi_paged_backend.runner.rewrites.pipeline import model_rewrites
from tgi_paged_kernels.cpu_native import native_kernels

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="no C++ compiler here: no native kernels")

WRAPPED = {
    "Llama": 2,
    "Mistral": 2,
    "Qwen2": 2,
    "Qwen3": 2,  # q/k norms per head
    "Granite": 2,  # residual multiplier, attention multiplier as the scale
    "Gemma": 2,  # 1 + w norms, GeGLU
    "Gemma2": 2,  # sandwich norms, soft-cap, a sliding and a full layer
    "Gemma3": 2,  # sandwich norms, q/k norms (1 + w), a sliding and a full layer
    "OLMo2": 2,  # post-norms only, q/k norms over all heads
    "Mixtral": 2,  # MoE: router softmax, top-2 renormalized, each expert's gated MLP, in the native call
    "Phi3": 2,  # q/k/v and gate/up fused in the checkpoint
    "Cohere": 2,  # parallel attention and MLP, LayerNorm without bias, interleaved RoPE
    "Cohere2": 2,  # the same, a sliding layer (interleaved RoPE) and a full layer (no RoPE)
    "StarCoder2": 2,  # LayerNorms with bias, biases everywhere, ungated GeLU-tanh MLP, sliding window
    "GPT-J": 2,  # parallel, one LayerNorm with bias, partial interleaved rotary from (sin, cos) half tables
    "GPT-NeoX": 2,  # parallel with two LayerNorms, per-head q/k/v rows, partial rotary, exact GeLU
    "Phi": 2,  # parallel, LayerNorm with bias, partial rotary, biases everywhere, ungated GeLU MLP (fc1, fc2)
    "GPT-BigCode": 2,  # multi-query (one KV head) from c_attn, no RoPE (learned positions), GeLU-tanh c_fc/c_proj
    "GPT-2": 2,  # Conv1D projections linearized at load (weights transposed once), no RoPE
    "OPT": 2,  # q scaled before the attention call, biases, ReLU MLP on the layer itself (fc1, fc2)
    "Falcon": 2,  # new architecture: grouped q/k/v rows per KV head, parallel with two LayerNorms, exact GeLU
    "Falcon-7B": 2,  # old architecture: multi-query, parallel with one LayerNorm, no biases
    "Falcon-RW": 0,  # ALiBi
    "Qwen3-MoE": 2,  # MoE (top-k as the softmax gave it, or renormalized: found by running the router), q/k norms
    "Qwen2-MoE": 2,  # MoE plus a shared expert (fused gate/up), scaled by sigmoid of its one-row gate
    "gpt-oss": 0,  # interleaved, biased, clamped experts; sinks
    "Bloom": 0,  # ALiBi
    "MPT": 0,  # ALiBi
}
"""Layers of the 2 of each tiny family that decode natively, and why the others do not."""

KEPT = {
    "gpt-oss": "GptOssDecoderLayer: MoE: ",
    "Bloom": "BloomBlock: ALiBi position biases: the native decode attention takes no slopes",
    "MPT": "MptBlock: ALiBi position biases: the native decode attention takes no slopes",
    "Falcon-RW": "FalconDecoderLayer: ALiBi position biases: the native decode attention takes no slopes",
}


def _runner(path, **model_options) -> ModelRunner:
    return ModelRunner(ModelConfig(model_id=str(path), **model_options), CacheConfig(block_size=4))


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_which_layers_decode_natively(family_dir, name) -> None:
    runner = _runner(family_dir(name))
    wrapped = [m for m in runner.model.modules() if isinstance(m, NativeDecoderLayer)]
    assert len(wrapped) == WRAPPED[name]
    assert runner.native_layers is not None and runner.native_layers.wrapped == WRAPPED[name]
    if name in KEPT:  # the start-up log says why
        assert any(KEPT[name] in line for line in runner.native_layers.kept)
    if wrapped:  # the wrapped layer's parts read through (transformers' model loop and our tools use them)
        assert isinstance(layer_attention(wrapped[0]), FusedPagedAttention)


def test_off_by_config_with_fp8_kv_and_with_the_compiled_step(family_dir) -> None:
    path = family_dir("Llama")
    assert _runner(path, native_layers=False).native_layers is None
    assert _runner(path, compile_decode=True).native_layers is None  # its static step traces the per-op path
    fp8 = ModelRunner(ModelConfig(model_id=str(path)), CacheConfig(block_size=4, kv_cache_dtype="fp8_e4m3fn"))
    assert fp8.native_layers is None


def _count_native_calls(monkeypatch) -> list[int]:
    """Rows of each native decode call from now on (the wrapped layers' one-call step)."""
    calls: list[int] = []
    real = native_layers.decode_layer

    def counted(*args, **kwargs):
        calls.append(int(args[2].shape[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(native_layers, "decode_layer", counted)
    return calls


def _steps(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[torch.Tensor]:
    """Prefill, then greedy decode steps; the logits of each step."""
    blocks = 8
    runner.allocate_kv_cache(len(prompts) * blocks + 1)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(len(prompts))]
    logits = [runner.forward(build_forward_batch([RequestChunk(p, 0, t) for p, t in zip(prompts, tables)], 4))]
    lengths = [len(p) for p in prompts]
    for _ in range(new_tokens):
        ids = logits[-1].argmax(dim=-1).tolist()
        chunks = [RequestChunk([i], n, t) for i, n, t in zip(ids, lengths, tables)]
        logits.append(runner.forward(build_forward_batch(chunks, 4)))
        lengths = [n + 1 for n in lengths]
    return logits


@pytest.mark.parametrize(
    "name",
    [
        "Llama",
        "Mistral",
        "Qwen2",
        "Qwen3",
        "Gemma",
        "Gemma2",
        "Gemma3",
        "Granite",
        "OLMo2",
        "Cohere",
        "Cohere2",
        "Phi",
        "GPT-NeoX",
        "GPT-J",
        "StarCoder2",
        "GPT-BigCode",
        "GPT-2",
        "OPT",
        "Falcon",
        "Falcon-7B",
        "Mixtral",
        "Qwen3-MoE",
        "Qwen2-MoE",
    ],
)
def test_native_runners_give_the_logits_and_tokens_of_the_per_op_path(family_dir, monkeypatch, name) -> None:
    path = family_dir(name)
    prompts = [[3, 17, 5, 9, 11, 2, 8, 13, 21, 4, 6], [7, 7, 1, 30, 2], [12]]
    runner = _runner(path)
    calls = _count_native_calls(monkeypatch)
    native = _steps(runner, prompts, 12)  # Mistral's window (tiny config) is passed on the way
    assert calls == [3] * (12 * 2)  # every decode step of both layers ran natively (learned positions, Falcon too)
    plain = _steps(_runner(path, native_layers=False), prompts, 12)
    for got, expected in zip(native, plain):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(dim=-1), expected.argmax(dim=-1))


def test_another_cpu_decode_kernel_keeps_the_per_op_decode(family_dir) -> None:
    """TGI_PAGED_CPU_DECODE=sdpa asks for that attention: wrapped layers then decode per op."""
    path = family_dir("Llama")
    prompts = [[3, 17, 5, 9, 11], [7, 7, 1]]
    sdpa = _runner(path, cpu_decode="sdpa")
    calls = []
    for module in sdpa.model.modules():
        if isinstance(module, NativeDecoderLayer):
            real = module.layer.forward
            module.layer.forward = lambda *a, real=real, **k: calls.append(1) or real(*a, **k)
    got = _steps(sdpa, prompts, 2)
    assert len(calls) == 2 * 3  # 2 layers x (prefill + 2 decode steps), all through the wrapped layer
    for a, b in zip(got, _steps(_runner(path), prompts, 2)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_layer_that_differs_keeps_the_python_path(family_dir, monkeypatch) -> None:
    """The load-time check compares one decode step with the original's: a wrong kernel is not used."""
    real = native_layers.decode_layer

    def off_by_a_bit(*args, **kwargs):
        return real(*args, **kwargs) * 1.001

    monkeypatch.setattr(native_layers, "decode_layer", off_by_a_bit)
    runner = _runner(family_dir("Llama"))
    assert runner.native_layers is not None and runner.native_layers.wrapped == 0
    assert any("differs" in reason for reason in runner.native_layers.kept)


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("Gemma3", dict(norm="rms")),
        ("Gemma3", dict(qk_norm_kind="rms")),
        ("Gemma3", dict(attn_out_norm=False)),
        ("Gemma3", dict(qk_norm="none")),
        ("Gemma", dict(activation="silu")),
        ("Gemma2", dict(softcap=0.0)),
        ("Gemma2", dict(window=4)),  # the sliding layer's 8, the full layer's 0
        ("Granite", dict(residual_scale=1.0)),
        ("OLMo2", dict(qk_norm="head")),
        ("Qwen2", dict(qkv_bias=False)),
        ("Cohere", dict(rope="neox")),
        ("Cohere", dict(norm="rms")),
        ("Cohere", dict(parallel=False)),
        ("Phi", dict(rotary_dim=0)),
        ("Phi", dict(norm_bias=False)),
        ("Phi", dict(o_bias=False)),
        ("Phi", dict(mlp_bias=False)),
        ("GPT-NeoX", dict(mlp_in_norm=False)),
        ("GPT-NeoX", dict(activation="gelu_tanh")),
        ("GPT-J", dict(rope="neox")),
        ("GPT-2", dict(rope="neox")),  # learned positions: the check's random tables must not be applied
        ("GPT-2", dict(activation="gelu")),  # gelu_new is the tanh approximation
        ("GPT-BigCode", dict(norm_bias=False)),
        ("OPT", dict(activation="gelu")),
        ("OPT", dict(scale=0.25**0.5)),  # the query's own scaling not folded in
        (
            "OPT",
            dict(post_add_norms=True, attn_in_norm=False, mlp_in_norm=False, attn_out_norm=True, mlp_out_norm=True),
        ),  # post-LN taken for pre-LN
        ("Falcon", dict(parallel=False)),
        ("Falcon", dict(mlp_in_norm=False)),  # ln_attn for both blocks: ln_mlp ignored
        ("Falcon-7B", dict(rope="none")),
        ("Mixtral", dict(norm_top_k=False)),
        ("Mixtral", dict(top_k=1)),
        ("Qwen3-MoE", dict(experts=3)),  # fewer experts than the router has: weights that do not fit
        ("Qwen2-MoE", dict(shared_expert=False)),  # the shared expert left out: weights that do not fit
    ],
)
def test_a_wrong_description_is_never_served(family_dir, monkeypatch, name, change) -> None:
    """The form derived from the module, with one part wrong: the load-time check (or the weights' fit to
    the form) keeps every layer on the Python path."""
    real = layer_forms.layer_form

    def wrong(layer):
        found = real(layer)
        assert not isinstance(found, str)
        return dataclasses.replace(found[0], **change), found[1]

    monkeypatch.setattr(layer_forms, "layer_form", wrong)  # what layer_weights reads
    runner = _runner(family_dir(name))
    assert runner.native_layers is not None and runner.native_layers.wrapped == 0
    assert runner.native_layers.kept


def test_a_partial_rotary_phi3_is_served_as_transformers_computes_it(tmp_path) -> None:
    """Phi-4-mini's form: Phi-3 layers whose rotary covers part of each head (``partial_rotary_factor``). The
    load-time checks must see the rotary width the model really has, or a fusion that rotates whole heads
    passes them and then fails (or differs) when serving."""
    from tests.helpers.family_models import FAMILIES, write_family_model

    family = next(f for f in FAMILIES if f.name == "Phi3")
    partial = dataclasses.replace(family, overrides={**family.overrides, "partial_rotary_factor": 0.5})
    path = write_family_model(partial, tmp_path / "phi3-partial")
    prompts = [[3, 17, 5, 9, 11, 2, 8, 13, 21, 4, 6], [7, 7, 1, 30, 2]]
    runner = _runner(path)
    assert runner.native_layers is not None and runner.native_layers.wrapped == 2  # the native layer rotates part too
    served = _steps(runner, prompts, 6)
    plain = ModelRunner(
        ModelConfig(model_id=str(path)), CacheConfig(block_size=4), rewrites=model_rewrites(without=("fuse",))
    )
    reference = _steps(plain, prompts, 6)
    for got, want in zip(served, reference):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("OPT", dict(do_layer_norm_before=False)),  # OPT-350m: post-LN, h = norm(h + block(h))
        ("Falcon-7B", dict(multi_query=False, parallel_attn=False)),  # per-head q/k/v rows, sequential blocks
        ("Falcon", dict(num_ln_in_parallel_attn=1)),  # new architecture, one LayerNorm for both blocks
        ("GPT-BigCode", dict(multi_query=False)),  # per-head q/k/v rows of c_attn
    ],
)
def test_config_variants_are_served_as_transformers_computes_them(tmp_path, monkeypatch, name, overrides) -> None:
    """Variants whose layer form depends on the config (norm placement, the q/k/v rows' layout): each is
    described, proven at load, and decodes natively to the logits of transformers' own modules."""
    from tests.helpers.family_models import FAMILIES, write_family_model

    family = next(f for f in FAMILIES if f.name == name)
    path = write_family_model(dataclasses.replace(family, overrides={**family.overrides, **overrides}), tmp_path / "m")
    prompts = [[3, 17, 5, 9, 11, 2, 8, 13, 21, 4, 6], [7, 7, 1, 30, 2]]
    runner = _runner(path)
    assert runner.native_layers is not None and runner.native_layers.wrapped == 2, runner.native_layers
    calls = _count_native_calls(monkeypatch)
    served = _steps(runner, prompts, 6)
    assert calls == [2] * (6 * 2)
    plain = ModelRunner(
        ModelConfig(model_id=str(path)), CacheConfig(block_size=4), rewrites=model_rewrites(without=("fuse",))
    )
    reference = _steps(plain, prompts, 6)
    for got, want in zip(served, reference):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1))


class _Scaled(torch.nn.Module):
    """A projection whose output is 1 % off: what a native linear reading its weights wrongly would give."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 1.01


@pytest.mark.parametrize(("name", "options"), [("Llama", {}), ("Qwen2", {"quantize": "fp8"}), ("Llama", "lora")])
def test_native_projections_that_change_a_prefill_are_never_served(
    family_dir, monkeypatch, tmp_path, name, options
) -> None:
    """The modules prefills run after the swap (``own_projections``: native linears over the packed weights) are
    checked on a prefill against the module's own: a wrong one (the fused q/k/v 1 % off; fp8 bytes read as int8, the
    bug the decode check could not see) keeps every layer on the Python path, the original projections put back
    (under the LoRA wrappers of a model with adapters)."""
    from tests.helpers.lora_adapters import write_adapter
    from tgi_paged_kernels import PackedInt8

    if options == "lora":
        options = {"lora_adapters": f"a={write_adapter(family_dir(name), tmp_path / 'a', seed=2)}"}
    real = NativeDecoderLayer._linear

    def wrong(self, index, width, bias, in_features):
        if "quantize" in options:  # the fp8 flag dropped: the tile decodes e4m3 bytes as int8 codes
            zeros, scales = self.weights.int8_columns[2 * index : 2 * index + 2]
            packed = PackedInt8((self.weights.qkv, self.weights.o, self.weights.gate_up, self.weights.down)[index],
                                zeros, scales, width, fp8=False)  # fmt: skip
            return native_layers.NativeInt8Linear(packed, bias, self.native)
        linear = real(self, index, width, bias, in_features)
        return _Scaled(linear) if index == 0 else linear

    monkeypatch.setattr(NativeDecoderLayer, "_linear", wrong)
    runner = _runner(family_dir(name), **options)
    assert runner.native_layers is not None and runner.native_layers.wrapped == 0, runner.native_layers
    assert any("prefill through the native projections differs" in k for k in runner.native_layers.kept)
    kinds = {type(m).__name__ for m in runner.model.modules()}
    assert not kinds & {"_Scaled", "NativeInt8Linear", "NativeLinear", "NativeDecoderLayer"}, kinds  # originals back
    monkeypatch.setattr(NativeDecoderLayer, "_linear", real)
    assert _runner(family_dir(name), **options).native_layers.wrapped == 2  # the right projections pass


def test_a_wrapped_layer_keeps_no_copy_of_its_original_projections(family_dir) -> None:
    """Once wrapped, the packed weights are the only copy: the original projections' weights are freed."""
    import gc
    import weakref

    originals: list[weakref.ref] = []
    real = NativeDecoderLayer.own_projections

    def watched(self):
        attn = layer_attention(self.layer)
        originals.append(weakref.ref(attn.qkv_proj.weight))
        real(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NativeDecoderLayer, "own_projections", watched)
        runner = _runner(family_dir("Llama"))
    gc.collect()
    assert runner.native_layers.wrapped == 2 and len(originals) == 2
    assert all(ref() is None for ref in originals)
