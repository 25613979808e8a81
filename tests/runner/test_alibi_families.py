"""Bloom and MPT (ALiBi) served through their paged attention modules (``runner/families/alibi.py``): slopes equal
to transformers' own, logits and greedy tokens equal to HF's at head counts that are not powers of two (Bloom's
extra slopes, MPT's reordering), with chunked prefill, mixed arrivals and preemption; the variants refused at
start, and each tensor-parallel rank's heads with their slopes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from tests.helpers.family_models import FAMILY_BY_NAME, family_config, write_family_model
from tests.helpers.paged_driver import PagedDriver, greedy_paged
from tests.helpers.tiny_models import load_reference
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.families.alibi import (
    BloomPagedAttention,
    MptPagedAttention,
    bloom_alibi_slopes,
    mpt_alibi_slopes,
)
from tgi_paged_backend.runner.input_batch import RequestChunk, build_forward_batch
from tgi_paged_backend.runner.model.family_support import unsupported_reason
from tgi_paged_backend.runner.model.loader import load_model
from tgi_paged_backend.runner.model.spec import ModelSpec
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.parallel.slicing import shard_model

# Six heads: Bloom's slopes take the extra odd powers, MPT's the reordered halves of eight.
SIX_HEADS = {
    "Bloom": dict(hidden_size=48, n_head=6),
    "MPT": dict(d_model=48, n_heads=6, attn_config=dict(clip_qkv=0.3, softmax_scale=0.3)),
}
PROMPTS = [[5, 9, 33, 7, 100, 200, 17], list(range(10, 41)), [3, 44], [250, 251, 252, 253, 254, 255, 256, 257, 258]]
MAX_NEW = 10


@pytest.mark.parametrize("num_heads", [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 40, 64, 112])
def test_slopes_equal_transformers(num_heads):
    assert torch.equal(bloom_alibi_slopes(num_heads), _get_alibi_slopes(num_heads, torch.device("cpu")))
    hf_mpt = build_mpt_alibi_tensor(num_heads, 4)  # [heads, 1, 4]: slope * (key - last), last column 0
    assert torch.equal(mpt_alibi_slopes(num_heads), -hf_mpt[:, 0, 2])


@pytest.fixture(scope="module", params=["Bloom", "MPT"])
def six_head_model(request, tmp_path_factory):
    family = FAMILY_BY_NAME[request.param]
    family = dataclasses.replace(family, overrides={**family.overrides, **SIX_HEADS[request.param]})
    return request.param, write_family_model(family, tmp_path_factory.mktemp(request.param))


def _hf_greedy(model, prompt):
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                             do_sample=False)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_modules_swapped_and_prefill_logits_equal_hf(six_head_model):
    name, path = six_head_model
    runner = ModelRunner(ModelConfig(model_id=str(path)), CacheConfig(block_size=4), "cpu")
    swapped = [m for m in runner.model.modules() if isinstance(m, (BloomPagedAttention, MptPagedAttention))]
    assert len(swapped) == 2 and not runner.static_decode_supported
    runner.allocate_kv_cache(32)
    prompt = PROMPTS[1]
    chunk = RequestChunk(prompt, 0, list(range(1, 2 + len(prompt) // 4)), all_logits=True)
    logits = runner.forward(build_forward_batch([chunk], 4))
    with torch.no_grad():
        expected = load_reference(path)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=2e-4)


def test_greedy_equals_hf_chunked_mixed_and_preempted(six_head_model):
    name, path = six_head_model
    reference = load_reference(path)
    want = [_hf_greedy(reference, p) for p in PROMPTS]
    assert len({t for tokens in want for t in tokens}) > 8, f"{name}: the tiny model's tokens barely vary: {want}"
    runner = ModelRunner(ModelConfig(model_id=str(path)), CacheConfig(block_size=4), "cpu")
    got = greedy_paged(runner, PROMPTS, MAX_NEW, chunk_size=6, arrival_steps=[0, 1, 1, 3])
    assert got == want

    preempted = []

    def preempt_once(driver: PagedDriver) -> None:
        if driver.step_index == 8 and not preempted:
            driver.drop_kv(1)
            preempted.append(1)

    assert greedy_paged(runner, PROMPTS, MAX_NEW, chunk_size=6, hook=preempt_once) == want and preempted


@pytest.mark.parametrize(
    ("name", "overrides", "phrase"),
    [
        ("MPT", dict(attn_config=dict(qk_ln=True)), "qk_ln"),
        ("MPT", dict(attn_config=dict(alibi=False)), "alibi false"),
        ("MPT", dict(attn_config=dict(alibi_bias_max=16)), "alibi_bias_max=16"),
        ("MPT", dict(attn_config=dict(prefix_lm=True)), "prefix_lm"),
        ("Bloom", dict(pretraining_tp=2, slow_but_exact=True), "slow_but_exact"),
    ],
)
def test_variants_not_reproduced_are_refused(name, overrides, phrase):
    family = FAMILY_BY_NAME[name]
    config = family_config(dataclasses.replace(family, overrides={**family.overrides, **overrides}))
    reason = unsupported_reason(config)
    assert reason is not None and phrase in reason


@pytest.mark.parametrize("name", ["Bloom", "MPT"])
def test_served_configs_are_not_refused(name):
    assert unsupported_reason(family_config(FAMILY_BY_NAME[name])) is None


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_holds_its_heads_and_their_slopes(six_head_model, world_size):
    """Tensor parallelism: rank r's q/k/v (Bloom's per-head interleaved ``query_key_value``, MPT's ``Wqkv``
    blocks) are the full model's heads of rank r, and its ALiBi slopes are those heads' slopes (not the first
    ones); the output projection keeps those heads' input columns."""
    name, path = six_head_model
    full = load_model(ModelConfig(model_id=str(path)), "cpu").model
    spec = ModelSpec.from_hf_config(full.config, torch.float32)
    x = torch.randn(1, 3, spec.hidden_size)
    attn = _attention(full)
    with torch.no_grad():
        q, k, v = attn.split_heads(x)
        for rank in range(world_size):
            shard = load_model(ModelConfig(model_id=str(path)), "cpu").model
            layout = shard_model(shard, spec, rank, world_size, lambda t: t)
            local = _attention(shard)
            heads = slice(rank * layout.num_q_heads, (rank + 1) * layout.num_q_heads)
            assert local.num_heads == layout.num_q_heads == spec.num_q_heads // world_size
            for got, want in zip(local.split_heads(x), (q, k, v)):
                torch.testing.assert_close(got, want[:, heads], rtol=0, atol=0)
            assert torch.equal(local.alibi_slopes, attn.alibi_slopes[heads])
            out = local.out_proj if name == "MPT" else local.dense
            columns = slice(heads.start * spec.head_dim, heads.stop * spec.head_dim)
            full_out = attn.out_proj if name == "MPT" else attn.dense
            assert torch.equal(out.local.weight, full_out.weight[:, columns])


def _attention(model):
    return (
        model.transformer.h[1].self_attention if hasattr(model.transformer, "h") else model.transformer.blocks[1].attn
    )
