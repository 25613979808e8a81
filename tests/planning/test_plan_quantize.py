"""``tgi-paged-backend plan --quantize``: the planner's weight bytes are what a quantized shard holds,
and the CUDA KV pool grows by exactly the bytes saved."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tgi_paged_backend.cli import tools_app
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.runner.rewrites.pipeline import model_rewrites


def _plan(args: list[str], out: Path) -> dict:
    result = CliRunner().invoke(
        tools_app, ["plan", *args, "--workload", "tiny", "--requests", "20", "--overcommits", "2", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_weights_match_the_quantized_runner_and_the_pool_gains_them(tiny_llama_dir: Path, tmp_path: Path) -> None:
    common = ["--model", str(tiny_llama_dir), "--gpu", "L4", "--dtype", "float32"]
    plain = _plan(common, tmp_path / "plain.json")
    fp8 = _plan([*common, "--quantize", "fp8"], tmp_path / "fp8.json")
    # Without fuse and native, as for int8 below: the native fp8 layer's packed columns (padding, per-column fp32
    # zero points it does not read) change the resident bytes by a few KiB the planner does not count.
    runners = [
        ModelRunner(
            ModelConfig(model_id=str(tiny_llama_dir), quantize=q, dtype="float32"),
            CacheConfig(),
            "cpu",
            rewrites=model_rewrites(without=("fuse", "native")),
        )
        for q in (None, "fp8")
    ]
    # The planner counts the safetensors parameters (the runner also counts the rotary inv_freq buffers):
    # what quantization saves is the same to the byte.
    saved = plain["weights_bytes"] - fp8["weights_bytes"]
    assert saved == runners[0].weights_bytes - runners[1].weights_bytes > 0
    assert fp8["kv_budget_bytes"] - plain["kv_budget_bytes"] == saved


def test_int_weights_match_the_gptq_runner(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from tests.helpers.int_checkpoints import write_int_checkpoint

    common = ["--model", str(tiny_llama_dir), "--gpu", "L4", "--dtype", "float32"]
    plain = _plan(common, tmp_path / "plain.json")
    for quantize, fmt, bits, group in (("gptq", "gptq", 4, 32), ("compressed-tensors", "pack-quantized", 8, -1)):
        planned = _plan(
            [*common, "--quantize", quantize, "--bits", str(bits), "--group-size", str(group)],
            tmp_path / f"{quantize}.json",
        )
        ckpt = write_int_checkpoint(tiny_llama_dir, tmp_path / fmt, fmt, bits=bits, group_size=group)
        # Without fuse and native: stacking int8 q/k/v (gate/up) and the native int8 layer's per-column fp32 zero
        # points change the resident bytes by a few KiB the planner does not count yet (issue-39 closing note).
        runners = [
            ModelRunner(
                ModelConfig(model_id=str(m), quantize=q, dtype="float32"),
                CacheConfig(),
                "cpu",
                rewrites=model_rewrites(without=("fuse", "native")),
            )
            for m, q in ((tiny_llama_dir, None), (ckpt.path, quantize))
        ]
        saved = plain["weights_bytes"] - planned["weights_bytes"]
        assert saved == runners[0].weights_bytes - runners[1].weights_bytes > 0
        assert planned["kv_budget_bytes"] - plain["kv_budget_bytes"] == saved


def test_preset_llama_3_8b_fp8_is_about_half_int4_a_third_and_eetq_is_refused(tmp_path: Path) -> None:
    plain = _plan(["--model", "llama-3-8b", "--gpu", "H100"], tmp_path / "a.json")
    fp8 = _plan(["--model", "llama-3-8b", "--gpu", "H100", "--quantize", "compressed-tensors"], tmp_path / "b.json")
    assert 0.5 < fp8["weights_bytes"] / plain["weights_bytes"] < 0.6  # embeddings and head stay fp16
    assert fp8["num_blocks"] > plain["num_blocks"]
    gptq = _plan(["--model", "llama-3-8b", "--gpu", "H100", "--quantize", "gptq"], tmp_path / "c.json")
    assert 0.3 < gptq["weights_bytes"] / plain["weights_bytes"] < 0.4  # int4 g128; embeddings + head (2 GB) fp16
    result = CliRunner().invoke(tools_app, ["plan", "--model", "llama-3-8b", "--quantize", "eetq"])
    assert result.exit_code == 2 and "--quantize eetq is not supported" in result.output
