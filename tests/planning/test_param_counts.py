"""The planner's parameter accounting is what the model and its tensor-parallel shards really hold:
whole-model counts equal the safetensors headers of tiny models of every MoE family and the Llama-style
ones, and one rank's count equals the parameters ``shard_model`` leaves on rank 0 (heads, MLP and experts
split, embeddings/norms/routers whole, KV heads replicated when there are fewer than ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.family_models import FAMILIES, is_available, write_family_model
from tests.helpers.tiny_models import load_reference
from tgi_paged_backend.planning.model_facts import count_safetensors_params
from tgi_paged_backend.planning.param_counts import param_counts
from tgi_paged_backend.runner.model.spec import ModelSpec
from tgi_paged_backend.runner.parallel.slicing import shard_model

EXACT = ("Llama", "Mistral", "Qwen2", "Qwen3", "Phi3", "Mixtral", "Qwen2-MoE", "Qwen3-MoE", "gpt-oss")


def _model(name: str, tmp_path: Path) -> tuple[Path, dict]:
    (family,) = [f for f in FAMILIES if f.name == name]
    if not is_available(family):
        pytest.skip(f"transformers lacks {family.model_type}")
    path = write_family_model(family, tmp_path / name)
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config")
    return path, ({**cfg, **text} if isinstance(text, dict) else cfg)


@pytest.mark.parametrize("name", EXACT)
def test_whole_model_count_is_the_checkpoints(name: str, tmp_path: Path) -> None:
    path, cfg = _model(name, tmp_path)
    assert param_counts(cfg).held == count_safetensors_params(path)


@pytest.mark.parametrize("name", ["Llama", "Qwen2", "Mixtral", "Qwen2-MoE", "Qwen3-MoE", "gpt-oss"])
def test_one_ranks_count_is_what_the_shard_holds(name: str, tmp_path: Path) -> None:
    path, cfg = _model(name, tmp_path)
    kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    for world_size in sorted({2, 2 * kv_heads}):  # the second has fewer KV heads than ranks: replicated
        if cfg["num_attention_heads"] % world_size:
            continue
        model = load_reference(path)
        spec = ModelSpec.from_hf_config(model.config, torch.float32)
        shard_model(model, spec, 0, world_size, lambda t: t)
        held = sum(p.numel() for p in model.parameters())
        assert param_counts(cfg, world_size).held == held, f"{name} at N={world_size}"
        assert param_counts(cfg, world_size).active <= param_counts(cfg, world_size).held
