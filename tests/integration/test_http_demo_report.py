"""The demo's shard memory report seam: parsing ``/metrics`` samples, the JSON summary line, plain logs;
the per-group lines of a model with KV layer groups."""

from __future__ import annotations

import json

from integration.prometheus_text import parse_prometheus
from integration.serve_demo import (
    MemoryReport,
    ShardMetricsPoller,
    fetch_shard_memory_report,
    format_report,
    group_lines,
    plan_num_blocks,
)
from tests.telemetry.telemetry_samples import memory_stats
from tgi_paged_backend.config import TelemetryConfig
from tgi_paged_backend.telemetry.recorder import OtelRecorder
from tgi_paged_backend.telemetry.step_record import StepRecord

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


GROUPED_WARMUP = "warmup: 49 physical blocks x 16 tokens = 384 tokens; advertising 2304 (overcommit 6.0)"


def _groups_scrape(used: int, running: int, groups: list[tuple[str, int, int]]) -> str:
    """One ``/metrics`` text of a grouped pool: ``groups`` are (window label, held, reclaimed) in group order."""
    lines = [
        f'tgi_paged_kv_blocks{{state="used"}} {used}.0',
        f'tgi_paged_requests{{state="running"}} {running}.0',
        "tgi_paged_kv_physical_tokens 384.0",  # 48 blocks x 16 over 2 groups: a position fills one slot in each
    ]
    for g, (window, held, reclaimed) in enumerate(groups):
        lines.append(f'tgi_paged_kv_group_waste_ratio{{group="{g}",window="{window}"}} 0.125')
        lines.append(f'tgi_paged_kv_group_blocks{{group="{g}",window="{window}",state="held"}} {held}.0')
        lines.append(f'tgi_paged_kv_group_blocks{{group="{g}",window="{window}",state="reclaimed"}} {reclaimed}.0')
    return "\n".join(lines) + "\n"


def _report_text(report: MemoryReport) -> str:
    return format_report(
        report,
        requests=8,
        admitted_peak=8,
        prompt_lengths=[42] * 8,
        max_new_tokens=48,
        generated_tokens=384,
        elapsed_s=10.0,
    )


def test_group_lines_at_the_pools_peak():
    """A Gemma-2-like pool (full + window 16): the report takes the groups from the scrape with the most
    blocks in use (not a later one where the window has given back more), and per group says what one
    page map for all layers would hold for the same positions: held + given back."""
    poller = ShardMetricsPoller(port=1)
    poller.observe(parse_prometheus(_groups_scrape(10, 3, [("full", 5, 0), ("16", 5, 0)])))
    poller.observe(parse_prometheus(_groups_scrape(24, 4, [("full", 16, 0), ("16", 8, 8)])))  # the peak
    poller.observe(parse_prometheus(_groups_scrape(20, 2, [("full", 10, 0), ("16", 10, 30)])))
    poller.observe(parse_prometheus(_groups_scrape(0, 0, [("full", 0, 0), ("16", 0, 0)])))  # the final scrape
    assert poller.peak_used == 24 and poller.peak_groups_running == 4
    report = fetch_shard_memory_report([GROUPED_WARMUP], poller)
    assert [(g.group, g.window, g.held, g.reclaimed) for g in report.groups] == [(0, None, 16, 0), (1, 16, 8, 8)]
    assert report.groups_running == 4
    lines = group_lines(report, per_request=90)
    assert lines == [
        "KV layer groups: 2, blocks at the pool's peak, 4 requests running:",
        "  group 0 (full): 16 blocks held (internal waste 12.5%), keeps every position; one page map for all "
        "layers: 16",
        "  group 1 (window 16): 8 blocks held (internal waste 12.5%), 8 given back behind the window; one page map "
        "for all layers: 16",
        "  all groups: 24 held, 8 given back; one page map for all layers would hold 32 for the same positions "
        "(25.0% saved)",
        "  (stock TGI holds each running request's whole booking for all layers: 4 x 6 blocks x 2 groups = 48 "
        "such blocks)",
    ]
    text = _report_text(report)
    assert "\n".join(lines) in text
    assert text.index("physical blocks used (peak): 24") < text.index("KV layer groups: 2") < text.index("waste")
    assert report.physical_tokens == 384
    assert "physical pool: 48 blocks x 16 tokens over 2 KV layer groups = 384 tokens" in text
    assert "stock TGI worst-case reservation on the same pool: 4 (= 384 // (42 + 48))" in text


def test_a_uniform_model_prints_no_group_lines():
    """SmolLM2 (one group): the shard exports no group gauges, and the report is as before."""
    poller = ShardMetricsPoller(port=1)
    poller.observe(parse_prometheus(METRICS))
    report = fetch_shard_memory_report([WARMUP], poller)
    assert report.groups == [] and group_lines(report, per_request=90) == []
    assert "group" not in _report_text(report)
    one = _groups_scrape(20, 5, [("full", 20, 0)])  # one group exported anyway: still no lines
    poller.observe(parse_prometheus(one))
    report = fetch_shard_memory_report([WARMUP], poller)
    assert group_lines(report, per_request=90) == []


def test_group_lines_from_the_recorders_real_endpoint():
    """The names and labels the shard's recorder exports are the ones the poller reads."""
    rec = OtelRecorder(TelemetryConfig(metrics_port=0), rank=0)
    try:
        memory = memory_stats(
            num_free_blocks=25,
            num_retained_blocks=0,
            num_swapped_blocks=0,
            num_swap_total_blocks=0,
            num_swapped_requests=0,
            num_written_tokens=900,
        )
        rec.record_step(
            StepRecord(phase="decode", step_s=0.01, batch_size=4, tokens_computed=4, num_running=4, memory=memory)
        )
        poller = ShardMetricsPoller(rec.metrics_port)
        poller.scrape()
    finally:
        rec.shutdown()
    assert poller.samples == 1 and poller.peak_used == 75
    report = fetch_shard_memory_report([WARMUP], poller)
    assert [(g.window, g.held, g.reclaimed) for g in report.groups] == [(None, 60, 0), (4096, 15, 45)]
    text = _report_text(report)
    assert "group 1 (window 4096): 15 blocks held (internal waste 16.7%), 45 given back behind the window" in text
    assert "one page map for all layers would hold 120 for the same positions (37.5% saved)" in text


def test_tier_lines_from_the_recorders_real_endpoint():
    """With KV tiers on, the report prints one line per tier from what the recorder exports; none when off."""
    from tests.telemetry.telemetry_samples import TIERS

    rec = OtelRecorder(TelemetryConfig(metrics_port=0), rank=0)
    try:
        step = dict(phase="decode", step_s=0.01, batch_size=4, tokens_computed=4, num_running=4, memory=memory_stats())
        rec.record_step(StepRecord(**step))
        off = ShardMetricsPoller(rec.metrics_port)
        off.scrape()
        rec.record_step(StepRecord(**step, tiers=TIERS))
        on = ShardMetricsPoller(rec.metrics_port)
        on.scrape()
    finally:
        rec.shutdown()
    assert fetch_shard_memory_report([WARMUP], off).tiers == []
    report = fetch_shard_memory_report([WARMUP], on)
    text = _report_text(report)
    assert "KV tiers below the pool (prefix-hit tokens by tier: pool 16, host 8, disk 8):" in text
    assert "  host RAM: 30 / 40 rows used" in text and "let go: evicted 7, no_room 1" in text
    assert "  disk: 12 files" in text and "let go: evicted 3, ignored 2, queue_full 0, write_error 0" in text
    assert text.index("physical blocks used") < text.index("KV tiers below the pool") < text.index("\nwaste")
