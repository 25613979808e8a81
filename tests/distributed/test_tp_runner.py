"""Tensor-parallel runner parity: two gloo ranks (``tests/distributed/tp_worker.py``) decode greedily
through their shards' paged pools, token-identical to HF transformers, each rank holding half the
heads, half the KV bytes per block and about half the layer weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.helpers.paged_driver import greedy_hf
from tests.helpers.tiny_models import EOS_ID, PAD_ID, TINY_KINDS, load_reference
from tests.helpers.tp_spawn import run_tp_workers
from tgi_paged_backend.config import CacheConfig, ModelConfig
from tgi_paged_backend.runner.model_runner import ModelRunner

MAX_NEW = 12


def test_two_rank_runner_matches_hf_for_llama_qwen2_mistral(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    models = [tiny_model_factory(kind) for kind in TINY_KINDS]  # llama, qwen2 (q/k/v biases), mistral (window)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, 320, n).tolist() for n in (5, 17, 33)]
    result = run_tp_workers(models, prompts, MAX_NEW, tmp_path / "result.json")

    for model in models:
        got = result[str(model)]
        assert got["tokens"] == greedy_hf(load_reference(model), prompts, MAX_NEW, [EOS_ID], PAD_ID), model
        full = ModelRunner(ModelConfig(model_id=str(model)), CacheConfig(block_size=8), "cpu")
        for block_bytes, q_heads, kv_heads, weights in got["sizes"]:  # one row per rank
            assert (q_heads, kv_heads) == (full.spec.num_q_heads // 2, full.spec.num_kv_heads // 2)
            assert block_bytes * 2 == full.block_bytes  # KV bytes per token / N
            assert weights < 0.75 * full.weights_bytes  # layers halved; embeddings + lm_head replicated
