"""Falcon over the paged KV cache (``runner/families/falcon.py``): every variant transformers' Falcon has
gives HF's logits (prefill and decode, two requests at once) and HF's greedy tokens (a mixed batch, chunked
prefill); the q/k/v split equals transformers' own for each layout; the ALiBi variants (Falcon-RW's layout and
ALiBi over the others) likewise, with Falcon's slopes and scaling; configs transformers' Falcon cannot run are
refused at start naming the variant. The matrix rows (``Falcon``, ``Falcon-7B``, ``Falcon-RW``)
run the full scenarios in ``test_family_matrix.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from transformers.models.falcon import modeling_falcon
from transformers.models.falcon.modeling_falcon import build_alibi_tensor

from tests.helpers.family_matrix import run_scenario, start_error
from tests.helpers.family_models import Family, family_config, write_family_model
from tests.helpers.paged_driver import PagedDriver, greedy_paged
from tests.helpers.static_decode_stand_ins import CountingBackend
from tests.helpers.tiny_models import load_reference, reference_attention
from tests.helpers.triton_serving import LAUNCHERS, route_to_triton
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.attention import METADATA_KWARG
from tgi_paged_backend.runner.cpu.fused_blocks import FusedPagedAttention
from tgi_paged_backend.runner.families.falcon import PagedFalconAttention, falcon_alibi_slopes
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model.loader import load_model
from tgi_paged_backend.runner.model.spec import ModelSpec
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.parallel.slicing import shard_model

_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)

VARIANTS: dict[str, dict] = {
    # Falcon-40B / 180B: grouped KV heads, ln_attn + ln_mlp
    "new-gqa-2ln": dict(new_decoder_architecture=True, num_kv_heads=2, initializer_range=0.3),
    # one layer norm shared by attention and MLP, one KV head per query head, biases
    "new-mha-1ln": dict(
        new_decoder_architecture=True, num_kv_heads=4, num_ln_in_parallel_attn=1, bias=True, initializer_range=0.3
    ),
    # Falcon-7B: one KV head, parallel attention
    "old-mq-parallel": dict(
        new_decoder_architecture=False, multi_query=True, parallel_attn=True, initializer_range=0.3
    ),
    "old-mq-serial": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=False, initializer_range=0.3),
    # one KV head per query head, per-head interleaved q/k/v
    "old-mha-serial": dict(
        new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True, initializer_range=0.3
    ),
    "old-mha-parallel": dict(
        new_decoder_architecture=False, multi_query=False, parallel_attn=True, initializer_range=0.3
    ),
    # ALiBi in place of rotary: Falcon-RW's layout (the matrix's Falcon-RW row), and ALiBi over the other layouts
    "rw-mha-serial": dict(
        new_decoder_architecture=False,
        multi_query=False,
        parallel_attn=False,
        bias=True,
        alibi=True,
        initializer_range=0.3,
    ),
    "rw-new-gqa-2ln": dict(new_decoder_architecture=True, num_kv_heads=2, alibi=True, initializer_range=0.3),
    "rw-old-mq-parallel": dict(
        new_decoder_architecture=False, multi_query=True, parallel_attn=True, alibi=True, initializer_range=0.3
    ),
}
KV_HEADS = {"new-gqa-2ln": 2, "new-mha-1ln": 4, "old-mq-parallel": 1, "old-mq-serial": 1, "old-mha-serial": 4,
            "old-mha-parallel": 4, "rw-mha-serial": 4, "rw-new-gqa-2ln": 2, "rw-old-mq-parallel": 1}  # fmt: skip


def _family(name: str, **overrides) -> Family:
    return Family(f"Falcon-{name}", "falcon", {**_TINY, **VARIANTS.get(name, {}), **overrides}, name)


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            made[name] = write_family_model(_family(name), tmp_path_factory.mktemp(name))
        return made[name]

    return make


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_pool_holds_the_variants_kv_heads(name):
    config = family_config(_family(name))
    assert ModelSpec.from_hf_config(config, torch.float32).num_kv_heads == KV_HEADS[name]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_split_is_transformers_split(name):
    """Our q/k/v of a random fused projection are HF's (its broadcast keys are our KV head ``h // group``)."""
    config = family_config(_family(name))
    config._attn_implementation = "eager"
    hf = transformers.models.falcon.modeling_falcon.FalconAttention(config, layer_idx=0)
    ours = PagedFalconAttention(hf, config, 0, channel=None)  # type: ignore[arg-type]  # the split needs none
    fused = torch.randn(1, 5, hf.query_key_value.out_features)
    q_hf, k_hf, v_hf = hf._split_heads(fused)  # [1, T, H or Hkv, D]
    q, k, v = ours.split_heads(fused[0])
    torch.testing.assert_close(q, q_hf[0], rtol=0, atol=0)
    group = ours.num_heads // ours.num_key_value_heads
    if k_hf.shape[2] == ours.num_heads:  # new architecture: HF broadcasts each group's key to its heads
        k_hf, v_hf = k_hf[:, :, ::group], v_hf[:, :, ::group]
    torch.testing.assert_close(k, k_hf[0], rtol=0, atol=0)
    torch.testing.assert_close(v, v_hf[0], rtol=0, atol=0)


def _ours(attention) -> bool:
    """Our paged Falcon attention, or the fused attention made from it (one q/k/v GEMM: the rotary variants)."""
    return isinstance(attention, PagedFalconAttention) or (
        isinstance(attention, FusedPagedAttention) and attention.channel is not None
    )


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_are_hfs_in_prefill_and_decode(name, variant_dir):
    path = variant_dir(name)
    runner = ModelRunner(ModelConfig(model_id=str(path)), CacheConfig(block_size=4), "cpu")
    assert all(_ours(layer.self_attention) for layer in runner.model.transformer.h)
    reference = load_reference(path)
    prompts = [[3, 17, 5, 9, 11, 2, 8, 13, 21, 4, 6], [7, 7, 1, 30, 2]]
    blocks = 8
    runner.allocate_kv_cache(2 * blocks + 1)
    tables = [list(range(1 + i * blocks, 1 + (i + 1) * blocks)) for i in range(len(prompts))]
    chunks = [RequestChunk(p, 0, t, all_logits=True) for p, t in zip(prompts, tables)]
    prefill = runner.forward(build_forward_batch(chunks, 4))
    decode = runner.forward(build_forward_batch([RequestChunk([5], len(p), t) for p, t in zip(prompts, tables)], 4))
    with torch.no_grad():
        want = [reference(torch.tensor([p])).logits[0] for p in prompts]
        want_next = [reference(torch.tensor([[*p, 5]])).logits[0, -1] for p in prompts]
    torch.testing.assert_close(prefill, torch.cat(want), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode, torch.stack(want_next), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scenario", ["mixed_batch", "chunked_prefill"])
@pytest.mark.parametrize(
    "name",
    ["new-mha-1ln", "old-mq-serial", "old-mha-serial", "old-mha-parallel", "rw-new-gqa-2ln", "rw-old-mq-parallel"],
)
def test_greedy_tokens_are_hfs(name, scenario, variant_dir):
    # (new-gqa-2ln, old-mq-parallel and rw-mha-serial's layout are the matrix's Falcon, Falcon-7B and Falcon-RW rows:
    # all scenarios there)
    outcome = run_scenario(variant_dir(name), scenario)
    assert outcome.premise and outcome.got == outcome.want


def test_the_step_metadata_reaches_the_layers_only_during_the_call(variant_dir):
    runner = ModelRunner(ModelConfig(model_id=str(variant_dir("new-gqa-2ln"))), CacheConfig(block_size=4), "cpu")
    channel = runner.model.transformer.h[0].self_attention.channel
    assert all(layer.self_attention.channel is channel for layer in runner.model.transformer.h)
    seen = []
    kind = type(runner.model.transformer.h[0].self_attention)  # ours, or its fused form (the rotary variants)
    assert _ours(runner.model.transformer.h[0].self_attention)
    original = kind.forward

    def spy(self, *args, **kwargs):
        seen.append(self.channel.metadata)
        return original(self, *args, **kwargs)

    runner.allocate_kv_cache(4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kind, "forward", spy)
        runner.forward(build_forward_batch([RequestChunk([1, 2, 3], 0, [1])], 4))
    assert len(seen) == 2 and seen[0] is not None and seen[0] is seen[1] and channel.metadata is None
    with pytest.raises(RuntimeError, match=METADATA_KWARG):  # a plain call (generate) says what it lacks
        runner.model(input_ids=torch.tensor([[1, 2]]), use_cache=False)
    assert channel.metadata is None


@pytest.mark.parametrize("num_heads", [1, 3, 4, 6, 12, 32, 71])
def test_alibi_slopes_are_falcons_scaled_by_its_norm_factor(num_heads):
    """Falcon adds ``slope * key_pos`` to the raw ``q . k`` and scales both by ``1 / sqrt(head_dim)``; the
    kernels add the bias after scaling, so they get transformers' (bfloat16-rounded) slopes times that factor."""
    hf = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float32).view(num_heads, 2)[:, 1]
    assert torch.equal(falcon_alibi_slopes(num_heads, 16), hf / 4)


def test_the_reference_counts_the_alibi_bias_once(variant_dir):
    """The ALiBi variants are compared with transformers' SDPA path, which adds the bias once (as the original
    Falcon-RW code): this transformers' eager path either agrees, or adds it twice (the bias folded into its
    causal mask, then again before the scaling), which is what a model with doubled slopes gives on SDPA."""
    path = variant_dir("rw-mha-serial")
    assert reference_attention(path) == "sdpa"
    prompt = torch.tensor([[3, 17, 5, 9, 11, 2, 8, 13, 21, 4, 6, 40, 41, 42]])
    eager, sdpa = load_reference(path, "eager"), load_reference(path, "sdpa")
    with torch.no_grad():
        want, got_eager = sdpa(prompt).logits, eager(prompt).logits
        if torch.allclose(got_eager, want, rtol=1e-4, atol=1e-4):
            return
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(
                modeling_falcon, "build_alibi_tensor", lambda *args, **kwargs: 2 * build_alibi_tensor(*args, **kwargs)
            )
            doubled = sdpa(prompt).logits
    torch.testing.assert_close(got_eager, doubled, rtol=1e-4, atol=1e-4)


def test_a_config_transformers_cannot_run_is_refused(tmp_path):
    family = _family("old-mha-serial", num_kv_heads=2)
    error = start_error(write_family_model(family, tmp_path)) if _hf_fails(family) else "HF runs it"
    assert "num_kv_heads=2 != num_attention_heads=4" in error, error


def _hf_fails(family: Family) -> bool:
    """Whether transformers' own Falcon fails on ``family`` (the refusal is for configs it cannot run)."""
    model = transformers.AutoModelForCausalLM.from_config(family_config(family), attn_implementation="eager")
    try:
        model(torch.tensor([[1, 2, 3]]))
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("name", ["old-mq-parallel", "rw-mha-serial"])
def test_the_compiled_static_decode_step_traces_the_falcon_layers(name, variant_dir):
    """``TGI_PAGED_COMPILE``: the hand-over of the step's metadata traces with no graph break (fullgraph), and
    the compiled decode gives the eager path's tokens (rotary and ALiBi)."""
    path = variant_dir(name)
    prompts = [[3, 17, 5, 9, 11, 2, 8], [7, 7, 1, 30, 2, 40, 41, 42, 43, 44, 45, 46, 47], [9, 8]]

    def runner(**options) -> ModelRunner:
        return ModelRunner(ModelConfig(model_id=str(path), **options), CacheConfig(block_size=8), "cpu")

    eager = greedy_paged(runner(), prompts, 8, arrival_steps=(0, 1, 3), num_blocks=16)
    compiled = runner(compile_decode=True)
    torch._dynamo.reset()
    counters.clear()
    backend = CountingBackend()

    def hook(driver: PagedDriver) -> None:
        if driver.step_index == 0:
            driver.runner.prepare_static_decode(32, backend=backend)

    assert greedy_paged(compiled, prompts, 8, arrival_steps=(0, 1, 3), num_blocks=16, hook=hook) == eager
    assert len(backend.graphs) == 1 and not counters["graph_break"]
    assert compiled.static_decode is not None and sum(compiled.static_decode.counts.values()) > 0


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "name", ["new-gqa-2ln", "new-mha-1ln", "old-mq-parallel", "old-mha-serial", "rw-mha-serial", "rw-new-gqa-2ln"]
)
def test_each_rank_holds_its_heads_of_the_fused_projection(name, world_size, variant_dir):
    """Tensor parallelism: rank r's split of its ``query_key_value`` rows is the full split's query heads of
    rank r and the KV heads they read (whole groups, or with fewer KV heads than ranks the one its heads read);
    with ALiBi, the slopes of rank r's query heads."""
    path = str(variant_dir(name))
    full = load_model(ModelConfig(model_id=path), "cpu").model
    spec = ModelSpec.from_hf_config(full.config, torch.float32)
    x = torch.randn(3, spec.hidden_size)
    with torch.no_grad():
        attn = full.transformer.h[1].self_attention
        q, k, v = attn.split_heads(attn.query_key_value(x))
        for rank in range(world_size):
            shard = load_model(ModelConfig(model_id=path), "cpu").model
            layout = shard_model(shard, spec, rank, world_size, lambda t: t)
            local = shard.transformer.h[1].self_attention
            assert (local.num_heads, local.num_key_value_heads) == (layout.num_q_heads, layout.num_kv_heads)
            q_local, k_local, v_local = local.split_heads(local.query_key_value(x))
            heads = slice(rank * layout.num_q_heads, (rank + 1) * layout.num_q_heads)
            torch.testing.assert_close(q_local, q[:, heads], rtol=0, atol=0)
            first_kv = rank * spec.num_kv_heads // world_size if spec.num_kv_heads < world_size else None
            kv_heads = (
                slice(first_kv, first_kv + 1)
                if first_kv is not None
                else slice(rank * layout.num_kv_heads, (rank + 1) * layout.num_kv_heads)
            )
            torch.testing.assert_close(k_local, k[:, kv_heads], rtol=0, atol=0)
            torch.testing.assert_close(v_local, v[:, kv_heads], rtol=0, atol=0)
            if attn.alibi_slopes is None:
                assert local.alibi_slopes is None
            else:
                assert torch.equal(local.alibi_slopes, attn.alibi_slopes[heads])


@pytest.mark.parametrize("name", ["new-gqa-2ln", "rw-mha-serial"])
def test_the_triton_kernels_serve_falcon_inside_the_model(name, variant_dir, monkeypatch):
    """The CUDA code path (store, prefill, decode through the Triton launchers, interpreted) under Falcon's
    attention module: HF's greedy tokens for a mixed batch of the new architecture's grouped KV heads, and of
    Falcon-RW's ALiBi (the kernels' slopes)."""
    calls = route_to_triton(monkeypatch)
    outcome = run_scenario(variant_dir(name), "mixed_batch")
    assert set(LAUNCHERS) <= set(calls)
    assert outcome.premise and outcome.got == outcome.want


@pytest.mark.parametrize(
    "name, overrides",
    [("new-gqa-2ln", dict(parallel_attn=False)), ("old-mq-parallel", dict(num_ln_in_parallel_attn=2))],
)
def test_layer_norm_layouts_transformers_cannot_run_are_refused_by_the_probe(name, overrides, tmp_path):
    # transformers builds one set of layer norms and its forward reads the other (this transformers' Falcon):
    # the start-up probe forward fails, so the shard refuses instead of crashing on the first request.
    error = start_error(write_family_model(_family(name, **overrides), tmp_path))
    assert error is not None and "probe forward" in error and "FalconForCausalLM" in error, error
