"""``tgi-paged-backend plan`` for models mixing sliding-window and full-attention layers (issue 24): the plan
pages them by KV layer group as the shard does at Warmup (a block of one group's layers, ``plan_capacity``
with the groups, the budget grown by what the sliding groups do not hold), the simulator runs the manager
with the groups, and the report and the JSON show them. Uniform models plan as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tgi_paged_backend.cli import tools_app
from tgi_paged_backend.engine.capacity import plan_capacity
from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.planning.model_facts import load_model_facts
from tgi_paged_backend.planning.plan import PlanInputs
from tgi_paged_backend.planning.plan_report import format_plan
from tgi_paged_backend.planning.planner import make_plan
from tgi_paged_backend.planning.sim_allocators import PagedAllocator
from tgi_paged_backend.planning.workload import generate_trace

TRACE = generate_trace("sharegpt", 40, seed=3, max_new_tokens=256)
BUDGET = 8 * 1024**3

GEMMA2_9B = {  # google/gemma-2-9b's config.json: no layer_types (transformers alternates them)
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "sliding_window": 4096,
    "sliding_window_size": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 256,
    "cache_implementation": "hybrid",
    "torch_dtype": "float32",
}
GEMMA3_27B = {  # google/gemma-3-27b-it's layout: a multimodal config, 5 sliding : 1 full by sliding_window_pattern
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 168,
    },
    "vision_config": {"model_type": "siglip_vision_model"},
}


def _config_dir(tmp_path: Path, name: str, config: dict) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _plan(model: str, **kw):
    inputs = dict(
        model=model, device="cpu", kv_budget_bytes=BUDGET, block_size=16, max_prefill_tokens=512, overcommits=(2.0,)
    )
    return make_plan(PlanInputs(**{**inputs, **kw}), TRACE)


def _shard_capacity(plan, groups: LayerGroups):
    """What the shard's Warmup computes for the plan's inputs (``PagedShardEngine._plan``)."""
    spec = plan.rank_spec
    return plan_capacity(
        available_kv_bytes=plan.kv_budget_bytes,
        block_bytes=spec.kv_bytes_per_block(16) // spec.num_layers * groups.layers_per_block,
        block_size=16,
        num_blocks_cap=None,
        overcommit=plan.advised_overcommit,
        max_position_embeddings=spec.max_position_embeddings,
        max_input_tokens=None,
        max_total_tokens=plan.inputs.max_total_tokens,
        max_prefill_tokens=512,
        groups=groups,
    )


@pytest.mark.parametrize(
    ("name", "config", "windows", "per_block", "padding"),
    [
        ("gemma2", GEMMA2_9B, (None, 4096), 21, 0),
        ("gemma3", GEMMA3_27B, (None,) + (1024,) * 6, 10, 8),
    ],
)
def test_hybrid_plan_is_the_shards_grouped_capacity(tmp_path, name, config, windows, per_block, padding) -> None:
    model = _config_dir(tmp_path, name, config)
    plan = _plan(model)
    groups = plan.kv_groups
    assert groups is not None and groups.windows == windows  # layer_types derived as transformers does
    assert (groups.layers_per_block, groups.num_padding) == (per_block, padding)
    spec = plan.rank_spec
    assert plan.block_bytes == spec.kv_bytes_per_block(16, torch.float32) // spec.num_layers * per_block
    assert plan.capacity == _shard_capacity(plan, spec.kv_groups)
    assert plan.num_blocks == BUDGET // plan.block_bytes
    assert plan.physical_tokens == (plan.num_blocks - 1) // len(windows) * 16
    assert plan.capacity.budget_gain > 1.0

    # The same memory with one page map for all layers (TGI_PAGED_LAYER_GROUPS=0) advertises less.
    single = _plan(model, layer_groups=False)
    assert single.kv_groups == LayerGroups.uniform(spec.num_layers)
    assert single.capacity == _shard_capacity(single, LayerGroups.uniform(spec.num_layers))
    assert single.capacity.budget_gain == 1.0 and single.sim_config.groups is None
    assert plan.capacity.max_supported_total_tokens > single.capacity.max_supported_total_tokens
    assert any("TGI_PAGED_LAYER_GROUPS=0" in n for n in single.notes)

    # The simulator pages by the groups, on the grouped pool and the grown router budget.
    sim = plan.sim_config
    assert (sim.num_blocks, sim.groups, sim.budget_gain) == (plan.num_blocks, windows, plan.capacity.budget_gain)
    assert sim.kv_tokens == plan.physical_tokens
    assert PagedAllocator(sim).kv.group_windows == windows
    assert plan.comparison.best.finished == len(TRACE)

    held, final = plan.group_request_blocks(), plan.group_final_blocks()
    one_map = -(-plan.capacity.max_total_tokens // 16)
    assert held[0] == final[0] == one_map
    assert all(e <= h < one_map for e, h in zip(final[1:], held[1:]))  # the sliding groups keep ~ their window
    assert plan.capacity.budget_gain == pytest.approx(len(windows) * one_map / sum(final))  # at the end
    text = format_plan(plan)
    assert f"{len(windows)} KV layer groups, a block holds {per_block} layers' K/V" in text
    assert f"budget gain x{plan.capacity.budget_gain:.2f}" in text
    assert f"group 0      full, {per_block} layers: {one_map:,} blocks a request at its end (" in text
    assert f"group 1      window {windows[1]}, {per_block} layers: {final[1]:,} blocks a request at its end" in text
    assert f"at most {held[1]:,} while a prefill chunk reads its window" in text
    assert f"group {len(windows)}" not in text
    assert ("padding slots" in text) == bool(padding)
    out = json.loads(json.dumps(plan.to_dict()))
    assert out["kv_groups"]["windows"] == list(windows) and out["kv_groups"]["request_blocks"] == held
    assert out["kv_groups"]["final_blocks"] == final
    assert out["budget_gain"] == plan.capacity.budget_gain
    assert out["kv_groups"]["request_blocks_one_page_map"] == one_map


def test_uniform_models_plan_as_before(tiny_llama_dir: Path, tmp_path: Path) -> None:
    plan = _plan(str(tiny_llama_dir))
    spec = plan.rank_spec
    assert plan.kv_groups is not None and plan.kv_groups.num_groups == 1
    assert plan.block_bytes == spec.kv_bytes_per_block(16)
    assert plan.sim_config.groups is None and plan.sim_config.reclaim_window is None
    assert plan.capacity.budget_gain == 1.0
    assert "KV layer groups" not in format_plan(plan) and "group 0" not in format_plan(plan)
    assert plan.to_dict() == _plan(str(tiny_llama_dir), layer_groups=False).to_dict()  # the knob does nothing
    # Every layer windowed (Mistral without layer_types): one group that reclaims, no gain.
    mistral = dict(GEMMA2_9B, model_type="mistral", architectures=["MistralForCausalLM"], head_dim=128)
    windowed = _plan(_config_dir(tmp_path, "mistral", mistral))
    assert windowed.kv_groups == LayerGroups.uniform(42, 4096)
    assert windowed.sim_config.reclaim_window == 4096 and windowed.sim_config.groups is None
    assert windowed.block_bytes == windowed.rank_spec.kv_bytes_per_block(16)
    assert windowed.capacity.budget_gain == 1.0


def test_tensor_parallel_groups_come_from_the_unsharded_config() -> None:
    whole = load_model_facts("gpt-oss-120b", torch.float16).spec
    plan = _plan("gpt-oss-120b", num_shard=4, kv_budget_bytes=16 * 1024**3, max_total_tokens=32768)
    assert plan.rank_spec.layer_windows == whole.layer_windows and plan.rank_spec.num_kv_heads == 2
    assert plan.kv_groups == whole.kv_groups and plan.kv_groups.windows == (None, 128)
    assert plan.block_bytes == plan.rank_spec.kv_bytes_per_block(16, torch.float32) // 2  # 18 of 36 layers
    assert plan.capacity == _shard_capacity(plan, whole.kv_groups) and plan.capacity.budget_gain > 1.9


def test_cli_reads_tgi_paged_layer_groups_as_the_shard(tmp_path: Path) -> None:
    args = ["plan", "--model", "gemma-2-9b", "--gpu", "H100", "--workload", "tiny", "--requests", "20"]
    args += ["--max-prefill-tokens", "512", "--overcommits", "2"]
    out = tmp_path / "plan.json"
    grouped = CliRunner().invoke(tools_app, [*args, "--json", str(out)])
    assert grouped.exit_code == 0, grouped.output
    assert "2 KV layer groups, a block holds 21 layers' K/V" in grouped.output
    assert (
        "group 1      window 4096, 21 layers: 256 blocks a request at its end, at most 289 while a prefill chunk "
        "reads its window (one page map for all layers: 512)"
    ) in grouped.output
    assert json.loads(out.read_text())["kv_groups"]["layers_per_block"] == 21
    off = CliRunner().invoke(tools_app, args, env={"TGI_PAGED_LAYER_GROUPS": "0"})
    assert off.exit_code == 0, off.output
    assert "KV layer groups" not in off.output and "TGI_PAGED_LAYER_GROUPS=0: one page map" in off.output
    bad = CliRunner().invoke(tools_app, args, env={"TGI_PAGED_LAYER_GROUPS": "maybe"})
    assert bad.exit_code == 2 and "TGI_PAGED_LAYER_GROUPS='maybe' is invalid" in bad.output


def test_plan_equals_a_tiny_gemma3_shards_warmup(tmp_path: Path) -> None:
    """A real shard engine on a tiny Gemma 3 (one sliding layer of window 8, one full) and the planner on the
    same directory, KV budget and limits: the same block bytes, pool and advertised budget."""
    from tests.engine.conftest import make_engine, router_warmup
    from tests.helpers.family_models import FAMILIES, write_family_model

    model_dir = write_family_model(next(f for f in FAMILIES if f.name == "Gemma3"), tmp_path / "gemma3")
    engine = make_engine(model_dir, num_blocks=100_000, block_size=4)
    runner = engine.runner
    budget = 40 * runner.block_bytes_for(runner.kv_groups) + 123
    runner.available_kv_bytes = lambda fraction, activation_bytes=None: budget  # the runner's budget, pinned
    router_warmup(engine, 16, max_total_tokens=60)
    inputs = PlanInputs(
        model=str(model_dir),
        device="cpu",
        kv_budget_bytes=budget,
        block_size=4,
        max_prefill_tokens=16,
        max_total_tokens=60,
        overcommits=(engine.config.cache.overcommit,),
    )
    plan = make_plan(inputs, generate_trace("tiny", 8, seed=1, max_new_tokens=16))
    assert engine.kv.num_groups == 2 and plan.kv_groups == runner.kv_groups
    assert plan.block_bytes == runner.block_bytes
    assert plan.capacity == engine.capacity
    assert engine.capacity.num_blocks == 40 and engine.capacity.budget_gain > 1.0


def test_the_step_time_model_reads_only_the_window_of_sliding_layers() -> None:
    """The roofline's attended KV: a sliding layer reads at most its window, a full layer everything."""
    cost = make_plan(PlanInputs(model="gemma-2-9b", device="H100", block_size=16, overcommits=(2.0,)), TRACE)
    model = cost.sim_config.cost
    assert model.kv_windows == ((None, 0.5), (4096, 0.5))  # 21 full layers, 21 sliding ones
    assert model.attended_tokens(1000) == 1000
    assert model.attended_tokens(8192) == 0.5 * 8192 + 0.5 * 4096
    one_map = make_plan(
        PlanInputs(model="gemma-2-9b", device="H100", block_size=16, overcommits=(2.0,), layer_groups=False), TRACE
    )
    assert one_map.sim_config.cost.attended_tokens(8192) == 6144  # the model reads the same, however paged
    uniform = make_plan(PlanInputs(model="llama-3-8b", device="H100", block_size=16, overcommits=(2.0,)), TRACE)
    assert uniform.sim_config.cost.kv_windows == () and uniform.sim_config.cost.attended_tokens(8192) == 8192
