"""Tensor-parallel runner parity: two gloo ranks (``tests/distributed/tp_worker.py``) decode greedily
through their shards' paged pools, token-identical to HF transformers, each rank holding half the
heads, half the KV bytes per block and about half the layer weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.helpers.shard_driving import free_port
from tests.helpers.paged_driver import greedy_hf
from tests.helpers.tiny_models import EOS_ID, PAD_ID, TINY_KINDS, load_reference
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 12


def test_two_rank_runner_matches_hf_for_llama_qwen2_mistral(tiny_model_factory: Callable[..., Path],
                                                            tmp_path: Path) -> None:
    models = [tiny_model_factory(kind) for kind in TINY_KINDS]  # llama, qwen2 (q/k/v biases), mistral (window)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, 320, n).tolist() for n in (5, 17, 33)]
    out = tmp_path / "result.json"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed.tp_worker", "--rank", str(rank),
                               "--world-size", "2", "--port", str(port), "--prompts", json.dumps(prompts),
                               "--max-new", str(MAX_NEW), "--out", str(out), *map(str, models)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for rank in range(2)]
    try:
        logs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    result = json.loads(out.read_text())

    for model in models:
        got = result[str(model)]
        assert got["tokens"] == greedy_hf(load_reference(model), prompts, MAX_NEW, [EOS_ID], PAD_ID), model
        full = ModelRunner(ModelConfig(model_id=str(model)), CacheConfig(block_size=8), "cpu")
        for block_bytes, q_heads, kv_heads, weights in got["sizes"]:  # one row per rank
            assert (q_heads, kv_heads) == (full.spec.num_q_heads // 2, full.spec.num_kv_heads // 2)
            assert block_bytes * 2 == full.block_bytes  # KV bytes per token / N
            assert weights < 0.75 * full.weights_bytes  # layers halved; embeddings + lm_head replicated
