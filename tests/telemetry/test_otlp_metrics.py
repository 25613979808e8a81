"""OtelRecorder -> OTLP/gRPC -> a real receiver: names, resource, values, cumulative counters."""

from __future__ import annotations

from dataclasses import replace

import pytest
from opentelemetry import metrics as otel_metrics
from opentelemetry.sdk.metrics import MeterProvider
from otlp_sink import OtlpSink, points_by
from telemetry_samples import BUDGET, GiB, memory_stats, sample_steps

from tgi_paged_backend.config import TelemetryConfig
from tgi_paged_backend.telemetry.recorder import (
    METRIC_NAMES,
    NullRecorder,
    OtelRecorder,
    PreemptionLoggingRecorder,
    build_recorder,
)


@pytest.fixture
def recorder(otlp_sink: OtlpSink):
    config = TelemetryConfig(otlp_endpoint=otlp_sink.endpoint, otlp_service_name="tgi-paged-test")
    rec = OtelRecorder(config, rank=1, export_interval_s=3600)  # only explicit flushes export
    yield rec
    rec.shutdown()


def test_recorded_steps_arrive_with_design_names_and_values(recorder: OtelRecorder, otlp_sink: OtlpSink) -> None:
    recorder.record_budget(BUDGET)
    for record in sample_steps():
        recorder.record_step(record)
    assert recorder.force_flush()
    assert otlp_sink.wait_for(lambda: bool(otlp_sink.metric_requests))

    got = otlp_sink.latest_metrics()
    assert set(METRIC_NAMES) <= set(got), f"missing: {sorted(set(METRIC_NAMES) - set(got))}"
    assert {n for n in got if n.startswith("tgi_paged_")} == set(METRIC_NAMES)
    (resource,) = {tuple(sorted(r.items())) for r in otlp_sink.metric_resources()}
    assert dict(resource)["service.name"] == "tgi-paged-test"
    assert dict(resource)["tgi_paged.shard.rank"] == 1

    # pool gauges: the last snapshot
    assert points_by(got["tgi_paged_kv_usage_ratio"])[None].as_double == pytest.approx(0.75)
    blocks = {k: p.as_int for k, p in points_by(got["tgi_paged_kv_blocks"], "state").items()}
    assert blocks == {"free": 17, "used": 75, "retained": 5, "swapped": 3}
    assert points_by(got["tgi_paged_kv_physical_tokens"])[None].as_int == 800  # 100 blocks x 16 over 2 groups
    assert points_by(got["tgi_paged_kv_virtual_reserved_tokens"])[None].as_int == 4000
    waste = {k: p.as_double for k, p in points_by(got["tgi_paged_kv_waste_ratio"], "kind").items()}
    assert waste == pytest.approx({"internal": 100 / 1200, "reservation": 0.7, "external": 0.0})
    requests = {k: p.as_int for k, p in points_by(got["tgi_paged_requests"], "state").items()}
    assert requests == {"running": 3, "preempted": 1, "waiting": 1}
    assert points_by(got["tgi_paged_preempted_max_wait_seconds"])[None].as_double == pytest.approx(2.5)
    assert points_by(got["tgi_paged_kv_pool_bytes"])[None].as_int == 50 * GiB
    assert points_by(got["tgi_paged_device_memory_bytes"])[None].as_int == 80 * GiB

    # counters: monotonic, cumulative sums of the per-step deltas
    preemptions = got["tgi_paged_preemptions_total"].sum
    assert preemptions.is_monotonic and preemptions.aggregation_temporality == 2  # CUMULATIVE
    assert {k: p.as_int for k, p in points_by(got["tgi_paged_preemptions_total"], "mode").items()} == {
        "recompute": 1,
        "swap": 1,
    }
    assert {k: p.as_int for k, p in points_by(got["tgi_paged_swap_bytes_total"], "direction").items()} == {
        "out": 8192,
        "in": 4096,
    }
    assert points_by(got["tgi_paged_recomputed_tokens_total"])[None].as_int == 40
    assert points_by(got["tgi_paged_computed_tokens_total"])[None].as_int == 512 + 3 + 43
    assert points_by(got["tgi_paged_prefix_hit_tokens_total"])[None].as_int == 32
    assert points_by(got["tgi_paged_prefix_query_tokens_total"])[None].as_int == 96

    # histograms
    steps = points_by(got["tgi_paged_step_seconds"], "phase")
    assert (steps["prefill"].count, steps["decode"].count) == (1, 2)
    assert steps["decode"].sum == pytest.approx(0.033)
    assert list(steps["decode"].explicit_bounds)[:3] == [0.001, 0.0025, 0.005]
    batch = points_by(got["tgi_paged_batch_size"])[None]
    assert (batch.count, batch.sum) == (3, 11)
    wait = points_by(got["tgi_paged_preempted_wait_seconds"])[None]
    assert (wait.count, wait.sum) == (1, pytest.approx(2.0))
    assert got["tgi_paged_step_seconds"].unit == "s"
    parts = {
        (a["phase"], a["part"]): p
        for p in got["tgi_paged_step_part_seconds"].histogram.data_points
        for a in [{kv.key: kv.value.string_value for kv in p.attributes}]
    }
    assert set(parts) == {
        ("prefill", "forward"),
        ("prefill", "schedule"),
        ("decode", "forward"),
        ("decode", "schedule"),
        ("decode", "sample"),
    }
    assert (parts[("decode", "forward")].count, parts[("decode", "forward")].sum) == (2, pytest.approx(0.022))
    assert parts[("decode", "sample")].sum == pytest.approx(0.002)
    assert list(parts[("decode", "sample")].explicit_bounds)[:2] == [0.0001, 0.00025]


def test_counters_accumulate_across_exports_and_memory_refresh(recorder: OtelRecorder, otlp_sink: OtlpSink) -> None:
    steps = sample_steps()
    recorder.record_step(steps[1])
    assert recorder.force_flush()
    recorder.record_step(steps[1])
    # FilterBatch freed everything: gauges follow without a step
    recorder.record_memory(memory_stats(num_used_blocks=0, num_free_blocks=100), num_running=0, num_preempted=0)
    n = len(otlp_sink.metric_requests)
    assert recorder.force_flush()
    assert otlp_sink.wait_for(lambda: len(otlp_sink.metric_requests) > n)
    got = otlp_sink.latest_metrics()
    assert points_by(got["tgi_paged_preemptions_total"], "mode")["swap"].as_int == 2
    assert points_by(got["tgi_paged_swap_bytes_total"], "direction")["out"].as_int == 2 * 8192
    assert points_by(got["tgi_paged_kv_usage_ratio"])[None].as_double == 0.0
    assert {k: p.as_int for k, p in points_by(got["tgi_paged_requests"], "state").items()} == {
        "running": 0,
        "preempted": 0,
        "waiting": 0,
    }


def test_idle_steps_do_not_skew_step_histograms(recorder: OtelRecorder, otlp_sink: OtlpSink) -> None:
    idle = sample_steps()[0]
    recorder.record_step(replace(idle, batch_size=0, tokens_computed=0, step_s=0.005))
    assert recorder.force_flush()
    assert otlp_sink.wait_for(lambda: bool(otlp_sink.metric_requests))
    got = otlp_sink.latest_metrics()
    assert "tgi_paged_step_seconds" not in got and "tgi_paged_batch_size" not in got
    assert "tgi_paged_step_part_seconds" not in got
    assert points_by(got["tgi_paged_kv_usage_ratio"])[None].as_double == pytest.approx(0.60)


def test_global_meter_provider_is_never_touched(recorder: OtelRecorder) -> None:
    recorder.record_step(sample_steps()[0])
    assert not isinstance(otel_metrics.get_meter_provider(), MeterProvider)
    assert recorder.provider is not otel_metrics.get_meter_provider()


def test_build_recorder_picks_the_implementation_from_config(otlp_sink: OtlpSink) -> None:
    off = build_recorder(TelemetryConfig())
    assert isinstance(off, PreemptionLoggingRecorder) and isinstance(off.inner, NullRecorder)
    off.record_step(sample_steps()[1])
    off.shutdown()
    on = build_recorder(TelemetryConfig(otlp_endpoint=otlp_sink.endpoint), rank=0)
    assert isinstance(on, PreemptionLoggingRecorder) and isinstance(on.inner, OtelRecorder)
    assert on.inner.metrics_port is None
    on.record_step(sample_steps()[1])
    on.shutdown()  # the final export on shutdown delivers what was recorded
    assert otlp_sink.wait_for(lambda: "tgi_paged_preemptions_total" in otlp_sink.latest_metrics())
