"""The end-to-end layer-groups figure (``examples/bench_layer_groups.py``) on a very small setting: a tiny
Gemma 3 (5 sliding layers of window 8 to 1 full), block size 4, 6 requests of 40 new tokens, a pool of
two whole requests with groups off. With groups on, the same bytes admit more requests at once (the
router's worst-case booking) and finish in fewer steps with fewer preemptions (overcommit 6), and greedy
generates the same tokens as with one page map for all layers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bench_layer_groups.py"
NEW = 40


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_layer_groups", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in the module look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a shared 2-core box
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_groups_admit_more_on_the_same_bytes_with_the_same_tokens(bench, tmp_path):
    model_dir = bench.write_tiny_gemma3(tmp_path / "gemma3", window=8)
    (worst_case, default), text = bench.run(
        model_dir, requests=6, max_new_tokens=NEW, block_size=4, fit=2, overcommits=[1.0, 6.0]
    )
    for c in (worst_case, default):
        on, off = c.on, c.off
        assert (on.num_groups, on.layers_per_block, off.num_groups) == (6, 1, 1)
        assert on.pool_bytes == off.pool_bytes and on.num_blocks == 6 * off.num_blocks
        assert c.same_tokens and sorted(on.tokens) == list(range(1, 7))
        assert all(len(t) == NEW for t in on.tokens.values())
        assert on.advertised_tokens > off.advertised_tokens
        assert on.steps < off.steps
        assert on.reclaimed_blocks > 0 == off.reclaimed_blocks
        assert on.peak_bytes <= on.pool_bytes and off.peak_bytes <= off.pool_bytes
    # Worst-case booking: what the router admits runs without preemption; the groups admit more.
    on, off = worst_case.on, worst_case.off
    assert on.num_preemptions == off.num_preemptions == 0
    assert off.peak_running == 2 < on.peak_running
    # Overcommit: the router admits everything; the pages decide how many keep computing.
    on, off = default.on, default.off
    assert on.mean_running > off.mean_running and on.num_preemptions < off.num_preemptions
    assert "TGI_PAGED_OVERCOMMIT=1" in text and "TGI_PAGED_OVERCOMMIT=6" in text
    assert text.count("generated tokens identical (greedy)") == 2 and " NO " not in text
