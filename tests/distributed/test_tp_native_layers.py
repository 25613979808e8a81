"""Native decode layers on tensor-parallel ranks (two gloo ranks, ``tests/distributed/tp_worker.py``): each rank's
sliced layers decode through the native parts with the all-reduces between them
(``tgi_paged_kernels.cpu_layer_step.decode_layer_parts``), greedy tokens equal HF's, both ranks run the same
native steps; and when one rank's load-time check fails, no rank wraps a layer (their all-reduces would differ)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.family_models import FAMILIES, is_available, write_family_model
from tests.helpers.paged_driver import greedy_hf
from tests.helpers.tiny_models import EOS_ID, PAD_ID, load_reference
from tests.helpers.tp_spawn import run_tp_workers
from tgi_paged_kernels.cpu_native import native_kernels

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="no C++ compiler here: no native kernels")

MAX_NEW = 8
LAYERS = 2
FORMS = ("Llama", "Phi", "Gemma3", "Mixtral", "Qwen2-MoE")
"""Two pre-norms (two all-reduces a layer); Phi's parallel block with LayerNorms, partial rotary and biases on o
and the MLP (one all-reduce for both blocks, the replicated biases added once); Gemma 3's sandwich norms, q/k norms
and a sliding and a full layer (the post-norms apply to the all-reduced sums); MoE MLPs (each rank its slice of
every expert, the router replicated; Qwen2-MoE's shared expert sliced too)."""


def _models(names: tuple[str, ...], workdir: Path) -> dict[str, Path]:
    families = {f.name: f for f in FAMILIES if is_available(f)}
    return {name: write_family_model(families[name], workdir / name) for name in names if name in families}


def _prompts() -> list[list[int]]:
    return [np.random.default_rng(7).integers(4, 320, n).tolist() for n in (5, 19)]


def test_tensor_parallel_ranks_decode_natively_token_exact(tmp_path: Path) -> None:
    models = _models(FORMS, tmp_path)
    assert set(models) == set(FORMS)
    result = run_tp_workers(list(models.values()), _prompts(), MAX_NEW, tmp_path / "native.json", timeout_s=600)
    for name, path in models.items():
        got = result[str(path)]
        expected = greedy_hf(load_reference(path), _prompts(), MAX_NEW, [EOS_ID], PAD_ID)
        assert got["tokens"] == expected, name
        (layers0, steps0, _), (layers1, steps1, _) = got["native"]
        assert layers0 == layers1 == LAYERS, (name, got["native"])
        # every decode step after the prefill, every layer, on both ranks alike
        assert steps0 == steps1 >= LAYERS * (MAX_NEW - 2), (name, got["native"])


def test_one_rank_failing_its_check_keeps_every_rank_per_op(tmp_path: Path) -> None:
    models = _models(("Llama",), tmp_path)
    result = run_tp_workers(
        list(models.values()), _prompts(), MAX_NEW, tmp_path / "kept.json",
        extra_args=["--native-check-fails-on", "1"], timeout_s=300,
    )  # fmt: skip
    got = result[str(models["Llama"])]
    assert got["native"] == [[0, 0, 0], [0, 0, 0]]  # rank 0's check passed, rank 1's did not: neither wraps
    assert got["tokens"] == greedy_hf(load_reference(models["Llama"]), _prompts(), MAX_NEW, [EOS_ID], PAD_ID)


def test_bf16_ranks_decode_natively(tmp_path: Path) -> None:
    """``--dtype bfloat16`` under tensor parallelism: each rank's layers pass the bf16 check on their slices (the
    all-reduces as the identity) and decode through the native parts on both ranks alike (the parts' numerics:
    ``tests/kernels/test_cpu_layer_parts.py``)."""
    models = _models(("Llama", "Phi", "Mixtral", "Qwen2-MoE"), tmp_path)
    result = run_tp_workers(
        list(models.values()), _prompts(), MAX_NEW, tmp_path / "bf16.json", extra_args=["--dtype", "bfloat16"],
        timeout_s=600,
    )  # fmt: skip
    for name, path in models.items():
        got = result[str(path)]
        assert len(got["tokens"]) == len(_prompts()) and all(len(t) == MAX_NEW for t in got["tokens"]), name
        (layers0, steps0, bf16_0), (layers1, steps1, bf16_1) = got["native"]
        assert layers0 == layers1 == bf16_0 == bf16_1 == LAYERS, (name, got["native"])
        assert steps0 == steps1 >= LAYERS * (MAX_NEW - 2), (name, got["native"])
