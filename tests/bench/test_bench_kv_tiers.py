"""The KV-tiers figure (``examples/bench_kv_tiers.py --quick``) on the tiny Llama: every scenario's table
is printed with both sides, the tier's hits show up where the pool is too small, the restart serves from
disk, and greedy tokens are the same with the tier off and on. Speed is not asserted (report-only)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bench_kv_tiers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kv_tiers", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_quick_run_prints_every_scenario_with_identical_tokens(bench, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    before = torch.get_num_threads()
    js = tmp_path / "tiers.json"
    argv = ["bench_kv_tiers.py", "--quick", "--model", str(tiny_llama_dir), "--threads", "1", "--block-size", "8"]
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(js)])
    try:
        bench.main()
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert out.startswith("host: ") and "ISA: avx2" in out and "driver: in-process engine" in out
    for name in ("memory-bound:", "control:", "restart:"):
        assert name in out
    assert out.count("greedy tokens off vs on: identical") == 2
    assert "greedy tokens cold vs warm: identical" in out and "DIFFERENT" not in out
    for row in ("TTFT p50 (ms)", "TTFT p90 (ms)", "generated tok/s", "hit tokens: host", "hit tokens: disk"):
        assert out.count(row) == 3
    assert "control: tier on" in out and "restart: next-turn TTFT p50" in out

    import json

    memory, control, restart = json.loads(js.read_text())
    assert memory["working_set_tokens"] > memory["pool_tokens"]
    assert memory["working_set_tokens"] < memory["pool_tokens"] + memory["host_tokens"]
    assert control["working_set_tokens"] < control["pool_tokens"]
    on = [r for r in memory["runs"] if r["mode"] == "on"]
    assert on and on[0]["hits"]["host"] > 0 and on[0]["traffic"]["load_bytes"] > 0
    assert all(r["hits"]["host"] == 0 for r in control["runs"])
    warm = [r for r in restart["runs"] if r["mode"] == "warm"]
    assert warm and warm[0]["hits"]["disk"] > 0
    assert all(r["hits"]["disk"] == 0 for r in restart["runs"] if r["mode"] == "cold")
