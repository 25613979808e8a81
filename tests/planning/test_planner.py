"""Capacity planner: its arithmetic is the shard's (ModelSpec, ModelRunner, plan_capacity) and its
expectations are the simulator's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from tgi_paged_backend.config import CacheConfig, ConfigError, ModelConfig
from tgi_paged_backend.engine.capacity import plan_capacity
from tgi_paged_backend.planning.allocator_sim import simulate
from tgi_paged_backend.planning.model_facts import count_safetensors_params, estimate_params
from tgi_paged_backend.planning.plan import PlanInputs
from tgi_paged_backend.planning.plan_report import format_plan
from tgi_paged_backend.planning.planner import make_plan
from tgi_paged_backend.planning.workload import generate_trace
from tgi_paged_backend.runner.model.spec import ModelSpec

SMALL_TRACE = generate_trace("sharegpt", 60, seed=1, max_new_tokens=256)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path):
    from tgi_paged_backend.runner.model_runner import ModelRunner

    return ModelRunner(ModelConfig(model_id=str(tiny_llama_dir)), CacheConfig(block_size=16), "cpu")


@pytest.fixture(scope="module")
def tiny_plan(tiny_llama_dir: Path):
    inputs = PlanInputs(
        model=str(tiny_llama_dir),
        device="cpu",
        kv_budget_bytes=3_000_000,
        block_size=16,
        max_prefill_tokens=512,
        overcommits=(1.5, 3.0),
    )
    return make_plan(inputs, SMALL_TRACE)


def test_block_bytes_weights_and_activations_are_the_runners(tiny_plan, runner, tiny_llama_dir: Path) -> None:
    spec = ModelSpec.from_hf_config(transformers.AutoConfig.from_pretrained(tiny_llama_dir), torch.float32)
    assert tiny_plan.block_bytes == spec.kv_bytes_per_block(16) == runner.block_bytes
    assert tiny_plan.bytes_per_token == spec.kv_bytes_per_token(torch.float32)
    buffers = sum(b.numel() * b.element_size() for b in runner.model.buffers())
    assert tiny_plan.weights_bytes == runner.weights_bytes - buffers
    assert tiny_plan.activation_bytes == runner.profile_prefill(512)


def test_pool_is_plan_capacity_of_the_budget(tiny_plan) -> None:
    cap = plan_capacity(
        available_kv_bytes=3_000_000,
        block_bytes=tiny_plan.block_bytes,
        block_size=16,
        num_blocks_cap=None,
        overcommit=tiny_plan.advised_overcommit,
        max_position_embeddings=tiny_plan.facts.spec.max_position_embeddings,
        max_input_tokens=None,
        max_total_tokens=None,
        max_prefill_tokens=512,
    )
    assert tiny_plan.num_blocks == cap.num_blocks == 3_000_000 // tiny_plan.block_bytes
    assert tiny_plan.physical_tokens == (cap.num_blocks - 1) * 16
    assert tiny_plan.capacity.max_supported_total_tokens == cap.max_supported_total_tokens
    assert tiny_plan.sim_config.num_blocks == cap.num_blocks


def test_expectations_are_the_simulators(tiny_plan) -> None:
    again = simulate(SMALL_TRACE, "stock", tiny_plan.sim_config)
    assert again.to_dict() == tiny_plan.comparison.stock.to_dict()
    assert tiny_plan.advised_overcommit in (1.5, 3.0)
    text = format_plan(tiny_plan)
    assert "TGI_PAGED_OVERCOMMIT=" in text and "bytes per token" in text


def test_params_counted_from_safetensors_match_the_estimate(tiny_llama_dir: Path) -> None:
    import json

    counted = count_safetensors_params(tiny_llama_dir)
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    assert counted == estimate_params(cfg)


def test_presets_and_gpu_arithmetic() -> None:
    inputs = PlanInputs(model="llama-3-8b", device="A100-80", overcommits=(2.0,))
    plan = make_plan(inputs, SMALL_TRACE[:10])
    assert plan.bytes_per_token == 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x fp16
    assert plan.block_bytes == 16 * plan.bytes_per_token
    expected = int(0.9 * 80 * 1024**3 - plan.weights_bytes - plan.activation_bytes)
    assert plan.kv_budget_bytes == expected
    assert plan.num_blocks == expected // plan.block_bytes
    fp8 = make_plan(
        PlanInputs(model="llama-3-8b", device="H100", kv_cache_dtype="fp8_e4m3fn", overcommits=(2.0,)), SMALL_TRACE[:10]
    )
    assert fp8.bytes_per_token == plan.bytes_per_token // 2


def test_refusals_name_the_knob() -> None:
    with pytest.raises(ValueError, match="--gpu"):
        make_plan(PlanInputs(model="llama-3-8b", device="V100"), SMALL_TRACE[:3])
    with pytest.raises(ValueError, match="not a preset"):
        make_plan(PlanInputs(model="/nonexistent/model"), SMALL_TRACE[:3])
    with pytest.raises(ConfigError, match="TGI_PAGED_NUM_BLOCKS"):
        make_plan(
            PlanInputs(model="llama-3-8b", device="A10G", kv_budget_bytes=10 * 2**20, max_total_tokens=4096),
            SMALL_TRACE[:3],
        )


def test_num_shard_plans_one_rank() -> None:
    one = make_plan(PlanInputs(model="mixtral-8x7b", device="H200", overcommits=(2.0,)), SMALL_TRACE[:10])
    two = make_plan(PlanInputs(model="mixtral-8x7b", device="H100", num_shard=2, overcommits=(2.0,)), SMALL_TRACE[:10])
    eight = make_plan(
        PlanInputs(model="mixtral-8x7b", device="H100", num_shard=8, overcommits=(2.0,)), SMALL_TRACE[:10]
    )
    assert one.facts.num_params > 46e9  # eight experts counted, not one dense MLP
    assert two.weights_bytes_total == one.weights_bytes and one.weights_bytes > 2 * two.weights_bytes * 0.97
    assert two.bytes_per_token == one.bytes_per_token // 2  # 4 of the 8 KV heads per rank
    assert eight.bytes_per_token == one.bytes_per_token // 8 and eight.rank_spec.num_kv_heads == 1
    replicated = make_plan(
        PlanInputs(model="qwen3-30b-a3b", device="H100", num_shard=8, overcommits=(2.0,)), SMALL_TRACE[:10]
    )
    assert replicated.rank_spec.num_kv_heads == 1  # 4 KV heads over 8 ranks: one replicated head each
    assert replicated.bytes_per_token == 2 * 48 * 128 * 2
    with pytest.raises(ValueError, match="no KV memory.*--num-shard"):
        make_plan(PlanInputs(model="gpt-oss-120b", device="H100", num_shard=2), SMALL_TRACE[:3])
    with pytest.raises(ValueError, match="not divisible by 3"):
        make_plan(PlanInputs(model="mixtral-8x7b", device="H100", num_shard=3), SMALL_TRACE[:3])


@pytest.mark.parametrize(("limit", "expected"), [(0, 33 * 16), (100, 100)])
def test_capacity_without_a_position_limit_takes_the_pool(limit, expected):
    # Bloom's config names no position limit (ALiBi; max_position_embeddings 0): the pool bounds a request.
    cap = plan_capacity(
        available_kv_bytes=34 * 1024, block_bytes=1024, block_size=16, num_blocks_cap=None, overcommit=1.0,
        max_position_embeddings=limit, max_input_tokens=None, max_total_tokens=None, max_prefill_tokens=64,
    )  # fmt: skip
    assert cap.max_total_tokens == expected and cap.max_input_tokens == expected - 1


@pytest.mark.parametrize("preset, params, active", [("deepseek-v3", 671.0e9, 37.5e9), ("kimi-k2", 1026.4e9, 32.8e9)])
def test_latent_attention_presets_count_the_latent_once(preset, params, active) -> None:
    # MLA: kv_lora_rank (512) + qk_rope_head_dim (64) values per token and layer, replicated on every rank;
    # parameters: DeepSeek-V3's published 671 B (37 B active), Kimi K2's 1.03 T (32 B active).
    inputs = PlanInputs(model=preset, device="H200", num_shard=16, kv_budget_bytes=40 * 2**30, overcommits=(2.0,))
    plan = make_plan(inputs, SMALL_TRACE[:10])
    assert plan.bytes_per_token == (512 + 64) * 61 * 2
    assert plan.block_bytes == 16 * plan.bytes_per_token
    from tgi_paged_backend.planning.param_counts import param_counts

    counts = param_counts(plan.facts.config)
    assert abs(counts.held - params) / params < 0.002 and abs(counts.active - active) / active < 0.01
    heads = plan.facts.config["num_attention_heads"]
    per_head_kv = heads * (128 + 64 + 128) * 61 * 2  # the same model with a key (192) and a value (128) per head
    assert per_head_kv / plan.bytes_per_token == heads * 320 / 576  # 71x (V3), 36x (K2) fewer bytes
    assert "latent KV 512 + RoPE key 64" in format_plan(plan)
    fp8 = make_plan(dataclasses.replace(inputs, kv_cache_dtype="fp8_e4m3fn"), SMALL_TRACE[:10])
    assert fp8.bytes_per_token == plan.bytes_per_token // 2


@pytest.mark.parametrize("name", ["DeepSeek-V2", "DeepSeek-V3"])
def test_latent_attention_params_match_the_safetensors(name, tmp_path: Path) -> None:
    import json

    from tests.helpers.family_models import FAMILY_BY_NAME, write_family_model

    model_dir = write_family_model(FAMILY_BY_NAME[name], tmp_path / name)
    assert count_safetensors_params(model_dir) == estimate_params(json.loads((model_dir / "config.json").read_text()))
