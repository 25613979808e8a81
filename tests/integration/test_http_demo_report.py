"""The demo's shard memory report seam: parsing ``/metrics`` samples, the JSON summary line, plain logs."""

from __future__ import annotations

import json

from integration.serve_demo import (
    MemoryReport,
    ShardMetricsPoller,
    fetch_shard_memory_report,
    format_report,
    parse_prometheus,
    plan_num_blocks,
)

WARMUP = "warmup: 24 physical blocks x 16 tokens = 368 tokens; advertising 1104 (overcommit 3.0)"
PRESSURE = (
    "KV pool pressure: 3 preemption(s) in the last 0.2s (recompute=3), 120 tokens moved off the device; "
    "7 since start (recompute=5, swap=2)"
)
METRICS = """# HELP tgi_paged_kv_blocks Physical KV blocks by state
# TYPE tgi_paged_kv_blocks gauge
tgi_paged_kv_blocks{state="free"} 3.0
tgi_paged_kv_blocks{state="used"} 20.0
tgi_paged_kv_physical_tokens 368.0
tgi_paged_kv_waste_ratio{kind="internal"} 0.1
tgi_paged_kv_waste_ratio{kind="reservation"} 0.5
tgi_paged_kv_waste_ratio{kind="external"} 0.0
tgi_paged_requests{state="running"} 5.0
tgi_paged_preemptions_total{mode="recompute"} 4.0
tgi_paged_preemptions_total{mode="swap"} 1.0
tgi_paged_recomputed_tokens_total 210.0
"""


def test_parse_prometheus():
    values = parse_prometheus(METRICS)
    assert values[("tgi_paged_kv_blocks", (("state", "used"),))] == 20.0
    assert values[("tgi_paged_kv_physical_tokens", ())] == 368.0


def test_plain_log_lines_only():
    report = fetch_shard_memory_report(["Loading model", WARMUP, PRESSURE])
    assert (report.blocks_total, report.block_size, report.physical_tokens) == (23, 16, 368)
    assert report.preemptions == {"recompute": 5, "swap": 2}
    assert report.missing == ["blocks_used_peak", "waste", "tokens_recomputed"]


def test_json_summary_line():
    summary = {
        "event": "kv_memory",
        "block_size": 16,
        "blocks_total": 23,
        "blocks_used_peak": 23,
        "waste_slots": {"internal": 40, "reservation": 900, "external": 0},
        "preemptions": {"recompute": 6, "swap": 0},
        "tokens_computed": 900,
        "tokens_recomputed": 120,
        "running_peak": 6,
    }
    report = fetch_shard_memory_report([WARMUP, "kv memory " + json.dumps(summary)])
    assert report.blocks_used_peak == 23 and report.tokens_recomputed == 120 and report.waste_unit == "slots"
    assert not report.missing


def test_metrics_poller_values():
    poller = ShardMetricsPoller(port=1)
    values = parse_prometheus(METRICS)
    poller.samples, poller.last, poller.peak_used, poller.peak_running = 1, values, 22.0, 6.0
    poller.waste_sums, poller.waste_samples = {"internal": 0.2, "reservation": 1.0, "external": 0.0}, 2
    report = fetch_shard_memory_report([WARMUP], poller)
    assert report.blocks_used_peak == 22 and report.running_peak == 6
    assert report.waste == {"internal": 0.1, "reservation": 0.5, "external": 0.0}
    assert report.preemptions == {"recompute": 4, "swap": 1} and report.tokens_recomputed == 210
    text = format_report(
        report,
        requests=8,
        admitted_peak=8,
        prompt_lengths=[42] * 8,
        max_new_tokens=48,
        generated_tokens=384,
        elapsed_s=10.0,
    )
    assert "stock TGI worst-case reservation on the same pool: 4 (= 368 // (42 + 48))" in text
    assert "preemptions by mode: recompute=4, swap=1" in text
    assert "recompute tax: 210 tokens recomputed" in text
    waste = text[text.index("waste (mean over the run):") :].splitlines()
    assert waste[1].split()[:2] == ["internal", "10.0%"] and "physical" in waste[1]
    assert waste[2].split()[:2] == ["reservation", "50.0%"] and "NOT physical here" in waste[2]
    assert "stock TGI allocates the whole booking: 90 token slots per request" in text


def test_plan_num_blocks_fits_about_n_requests():
    assert plan_num_blocks([42] * 8, 48, fit=4) == 24  # 4 x 90 = 360 tokens -> 23 blocks + scratch
    assert isinstance(MemoryReport(), MemoryReport)
