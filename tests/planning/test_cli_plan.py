"""``tgi-paged-backend plan``."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tgi_paged_backend.cli import tools_app
from tgi_paged_backend.planning.workload import generate_trace, save_trace


def test_plan_with_a_model_dir_and_a_trace_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    trace = save_trace(tmp_path / "trace.jsonl", generate_trace("alpaca", 40, seed=2, max_new_tokens=128))
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        tools_app,
        [
            "plan",
            "--model",
            str(tiny_llama_dir),
            "--gpu",
            "L4",
            "--trace",
            str(trace),
            "--max-prefill-tokens",
            "512",
            "--kv-budget-bytes",
            "2000000",
            "--overcommits",
            "1.5,3",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "bytes per token" in result.output and "TGI_PAGED_OVERCOMMIT=" in result.output
    plan = json.loads(out.read_text())
    assert plan["num_blocks"] == 2_000_000 // plan["block_bytes"]
    assert plan["advised_overcommit"] in (1.5, 3.0)
    assert plan["trace"]["requests"] == 40


def test_plan_with_a_preset_and_generated_trace() -> None:
    result = CliRunner().invoke(
        tools_app,
        [
            "plan",
            "--model",
            "smollm2-135m",
            "--gpu",
            "a10g",
            "--workload",
            "tiny",
            "--requests",
            "30",
            "--overcommits",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "23,040 bytes per token" in result.output  # 30 layers x 3 KV heads x 64 x (K, V) x fp16


def test_plan_refuses_unknown_gpu() -> None:
    result = CliRunner().invoke(tools_app, ["plan", "--model", "llama-3-8b", "--gpu", "TPU"])
    assert result.exit_code == 2
    assert "--gpu" in result.output
