"""The load-time rewrite pipeline: order, the reasons a rewrite does not run, and what a real runner logs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model.spec import ModelSpec
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.rewrites.base import Decision, RewriteContext, runs, skip
from tgi_paged_backend.runner.rewrites.fuse import FuseBlocks
from tgi_paged_backend.runner.rewrites.lora_wrap import LoraWrap
from tgi_paged_backend.runner.rewrites.native import NativeLayers
from tgi_paged_backend.runner.rewrites.pipeline import model_rewrites, run_rewrites
from tgi_paged_backend.runner.rewrites.tp_slice import TensorParallelSlice

SPEC = ModelSpec.from_hf_config(
    SimpleNamespace(
        model_type="llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, vocab_size=100, max_position_embeddings=64,
    ),
    torch.float32,
)  # fmt: skip


def _ctx(**overrides: Any) -> RewriteContext:
    base = RewriteContext(
        model_config=ModelConfig(model_id="unused"), device=torch.device("cpu"), dtype=torch.float32,
        kv_dtype=torch.float32, block_size=16, spec=SPEC,
    )  # fmt: skip
    return replace(base, **overrides)


class Recording:
    def __init__(self, name: str, log: list[str], decision: Decision, requires: str | None = None) -> None:
        self.name, self.log, self.decision, self.requires = name, log, decision, requires

    def applies(self, model: nn.Module, ctx: RewriteContext, done: Mapping[str, Any]) -> Decision:
        if self.requires is not None and self.requires not in done:
            return skip(f"needs {self.requires}")
        return self.decision

    def apply(self, model: nn.Module, ctx: RewriteContext) -> tuple[str, int]:
        self.log.append(self.name)
        return f"report of {self.name}", len(self.log)


def test_rewrites_run_in_order_and_each_sees_what_ran_before() -> None:
    log: list[str] = []
    rewrites = [
        Recording("a", log, runs()),
        Recording("b", log, skip("not here")),
        Recording("c", log, runs(), requires="b"),
        Recording("d", log, runs(), requires="a"),
    ]
    applied = run_rewrites(nn.Linear(2, 2), _ctx(), rewrites)
    assert log == ["a", "d"]
    assert applied.get("a") == "report of a" and applied.get("b") is None and applied.get("d") == "report of d"
    assert applied.summary() == "a (1 modules); b skipped: not here; c skipped: needs b; d (2 modules)"


def test_the_default_order_and_leaving_one_out() -> None:
    assert [r.name for r in model_rewrites()] == ["tp_slice", "lora", "fuse", "native", "pack"]
    assert [r.name for r in model_rewrites(without=("fuse",))] == ["tp_slice", "lora", "native", "pack"]
    with pytest.raises(ValueError, match="unknown model rewrites"):
        model_rewrites(without=("fusion",))


def test_why_a_rewrite_does_not_run() -> None:
    model, fused = nn.Linear(2, 2), {"fuse": object()}
    assert TensorParallelSlice().applies(model, _ctx(), {}).reason == "one shard"
    assert LoraWrap().applies(model, _ctx(), {}).reason == "no LORA_ADAPTERS"
    assert "cuda" in FuseBlocks().applies(model, _ctx(device=torch.device("cuda")), {}).reason
    assert FuseBlocks().applies(model, _ctx(), {})
    native = NativeLayers()
    assert native.applies(model, _ctx(), fused)
    assert "fused blocks" in native.applies(model, _ctx(), {}).reason
    assert "fp32" in native.applies(model, _ctx(kv_dtype=torch.bfloat16), fused).reason
    off = replace(_ctx().model_config, native_layers=False)
    assert "NATIVE_LAYERS" in native.applies(model, _ctx(model_config=off), fused).reason
    compiled = replace(_ctx().model_config, compile_decode=True)
    assert "COMPILE" in native.applies(model, _ctx(model_config=compiled), fused).reason


def test_a_runner_reports_what_each_rewrite_did(tiny_llama_dir: Path) -> None:
    runner = ModelRunner(ModelConfig(model_id=str(tiny_llama_dir)), CacheConfig(block_size=16))
    ran = {o.name: o.ran for o in runner.rewrites.outcomes}
    assert ran == {"tp_slice": False, "lora": False, "fuse": True, "native": True, "pack": True}
    assert runner.fusion is not None and runner.fusion.attentions > 0
    assert runner.native_layers is not None and runner.native_layers.wrapped == runner.spec.num_layers
    plain = ModelRunner(
        ModelConfig(model_id=str(tiny_llama_dir)),
        CacheConfig(block_size=16),
        rewrites=model_rewrites(without=("fuse",)),
    )
    assert plain.fusion is None and plain.native_layers is None
    assert "native skipped: needs the fused blocks" in plain.rewrites.summary()
