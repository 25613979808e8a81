"""``tgi-paged-backend plan --host-cache-gb``: what a host KV tier adds to the pool's prefix cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tgi_paged_backend.cli import tools_app
from tgi_paged_backend.planning.host_tier import estimate_host_tier
from tgi_paged_backend.planning.planner import plan_from_args
from tgi_paged_backend.planning.workload import TraceRequest, generate_trace

GiB = 1024**3
ARGS = ["plan", "--model", "smollm2-135m", "--gpu", "a10g", "--workload", "sharegpt", "--requests", "30"]
ARGS += ["--overcommits", "2", "--kv-budget-bytes", str(64 * 2**20)]  # a pool far below the trace's prompts


@pytest.fixture(scope="module")
def plan_and_trace():
    kw = dict(workload="sharegpt", requests=30, arrival="burst", rate=None, max_new_tokens=None, seed=0)
    plan = plan_from_args(
        model="smollm2-135m",
        gpu="a10g",
        memory_gb=None,
        memory_fraction=0.9,
        block_size=16,
        dtype=None,
        kv_dtype="auto",
        trace_path=None,
        max_prefill_tokens=4096,
        num_blocks=None,
        kv_budget_bytes=64 * 2**20,
        overcommits=[2.0],
        **kw,
    )
    trace = generate_trace("sharegpt", 30, arrival="burst", rate=None, max_new_tokens=None, seed=0)
    return plan, trace


def test_blocks_follow_the_bytes_and_the_block_size(plan_and_trace):
    plan, trace = plan_and_trace
    e = estimate_host_tier(plan, trace, 0.01)
    assert e.host_blocks == int(0.01 * GiB) // plan.block_bytes > 0
    assert e.host_tokens == e.host_blocks * 16
    assert e.working_set_tokens == sum(r.prompt_tokens // 16 * 16 for r in trace)
    assert e.pool_cache_tokens <= plan.physical_tokens


def test_more_host_memory_keeps_more_prefix_and_lowers_ttft_until_the_working_set_fits(plan_and_trace):
    plan, _ = plan_and_trace
    trace = [TraceRequest(1500, 100, 0.0, 200) for _ in range(20)]  # long prompts: prefill is compute-bound
    none, some, lots = (estimate_host_tier(plan, trace, gib) for gib in (0.0, 0.005, 4.0))
    assert none.extra_kept_tokens == 0 and none.hit_rate_tiered == none.hit_rate_pool < 1.0
    assert none.ttft_tiered_s == pytest.approx(none.ttft_pool_s)
    assert 0 < some.extra_kept_tokens <= some.host_tokens
    assert none.hit_rate_tiered < some.hit_rate_tiered < lots.hit_rate_tiered == 1.0
    assert lots.kept_tokens_tiered == lots.working_set_tokens  # capped by what the trace can reuse
    assert lots.ttft_tiered_s < some.ttft_tiered_s < some.ttft_pool_s
    assert some.load_s_per_block < some.prefill_s_per_block  # PCIe copy of a block vs computing it on an A10G


def test_short_prompts_on_a_weight_bound_step_gain_nothing_in_ttft(plan_and_trace):
    """A prefill step of a few hundred tokens of a 135M model reads its weights longer than it computes:
    the roofline keeps the step time, and the copies come on top (stated, not hidden)."""
    plan, _ = plan_and_trace
    e = estimate_host_tier(plan, [TraceRequest(64, 16, 0.0, 16) for _ in range(400)], 1.0)
    assert e.hit_rate_tiered > e.hit_rate_pool
    assert e.ttft_tiered_s >= e.ttft_pool_s


def test_cli_prints_and_writes_the_estimate_deterministically(tmp_path: Path) -> None:
    outs = []
    for i in range(2):
        js = tmp_path / f"plan{i}.json"
        result = CliRunner().invoke(tools_app, [*ARGS, "--host-cache-gb", "0.01", "--json", str(js)])
        assert result.exit_code == 0, result.output
        outs.append((result.output.replace(str(js), ""), js.read_text()))
    assert outs[0] == outs[1]
    text, raw = outs[0]
    assert "host tier" in text and "expected prefix hit rate" in text and "assumes uniform revisits" in text
    tier = json.loads(raw)["host_tier"]
    assert tier["host_blocks"] == int(0.01 * GiB) // json.loads(raw)["block_bytes"]
    assert tier["extra_kept_tokens"] == tier["kept_tokens_tiered"] - tier["kept_tokens_pool"] > 0


def test_without_the_option_the_plan_is_unchanged(tmp_path: Path) -> None:
    js = tmp_path / "plan.json"
    result = CliRunner().invoke(tools_app, [*ARGS, "--json", str(js)])
    assert result.exit_code == 0, result.output
    assert "host tier" not in result.output and "host_tier" not in json.loads(js.read_text())


def test_a_negative_size_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(tools_app, [*ARGS, "--host-cache-gb", "-1"])
    assert result.exit_code == 2 and "--host-cache-gb must be >= 0" in result.output
