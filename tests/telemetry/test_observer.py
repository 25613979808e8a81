"""The engine's one telemetry observer: the hub forwards every report to its sinks in subscription order,
a sink that raises is logged and skipped (the step goes on), and the shard's sinks are wired where the
engine is built.

- ``TelemetryHub``: each report reaches every sink in order, ``close`` runs in reverse order; a failing
  sink neither raises nor stops the sinks after it, its first failure is logged with the traceback and
  the rest counted;
- ``build_shard_telemetry``: metrics, KV events, spans, in that order, over the recorder and KV events the
  engine is given; ``SpanSink`` describes only the router's steps (a batch id), on the current span;
- ``StepRecordBuilder``: with the engine's adapters the records count live requests per LoRA adapter;
- a real engine (tiny Llama) reports one record per step to its observer: a sink raising on every report
  breaks no step and no RPC, and the sink after it still sees every step (batch id and size for Prefill
  and Decode, none for Warmup's and the liveness probe's) and the snapshot after a ClearCache.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from loguru import logger
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import use_span
from telemetry_samples import BUDGET, memory_stats, sample_steps

from tests.engine.conftest import LIVENESS, RouterDriver, make_engine, make_text, router_warmup, spec
from tgi_paged_backend.engine.types import BatchSpec
from tgi_paged_backend.envs import build_config
from tgi_paged_backend.telemetry import observer as observer_module
from tgi_paged_backend.telemetry import recorder as recorder_module
from tgi_paged_backend.telemetry.engine_adapter import StepRecordBuilder
from tgi_paged_backend.telemetry.instruments import METRIC_NAMES
from tgi_paged_backend.telemetry.kv_events import NullKVEvents
from tgi_paged_backend.telemetry.observer import TelemetryHub, TelemetrySink
from tgi_paged_backend.telemetry.sinks import KVEventsSink, MetricsSink, SpanSink, build_shard_telemetry
from tgi_paged_backend.telemetry.step_record import SnapshotRecord

SNAPSHOT = SnapshotRecord(memory=memory_stats(), num_running=1, num_preempted=0, num_waiting=2)


class Recording(TelemetrySink):
    """Appends ``(name, report)`` to a shared log."""

    def __init__(self, name: str, log: list) -> None:
        self.name = name
        self.log = log

    def on_step(self, record) -> None:
        self.log.append((self.name, "step", record))

    def on_snapshot(self, record) -> None:
        self.log.append((self.name, "snapshot", record))

    def on_budget(self, budget) -> None:
        self.log.append((self.name, "budget", budget))

    def on_pool_reset(self) -> None:
        self.log.append((self.name, "pool_reset", None))

    def close(self) -> None:
        self.log.append((self.name, "close", None))


class Failing(TelemetrySink):
    """Raises on every report."""

    def __init__(self) -> None:
        self.calls = 0

    def _fail(self, *args) -> None:
        self.calls += 1
        raise RuntimeError("sink broken")

    on_step = on_snapshot = on_budget = _fail

    def on_pool_reset(self) -> None:
        self._fail()

    def close(self) -> None:
        self._fail()


@pytest.fixture
def log_lines():
    lines: list = []
    handle = logger.add(lambda message: lines.append(message.record), level="WARNING")
    yield lines
    logger.remove(handle)


def test_hub_forwards_each_report_in_subscription_order_and_closes_in_reverse() -> None:
    log: list = []
    hub = TelemetryHub((Recording("a", log),))
    b = hub.subscribe(Recording("b", log))
    assert [s.name for s in hub.sinks] == ["a", "b"] and hub.sinks[1] is b  # type: ignore[attr-defined]
    step = sample_steps()[0]
    hub.on_step(step)
    hub.on_snapshot(SNAPSHOT)
    hub.on_budget(BUDGET)
    hub.on_pool_reset()
    hub.close()
    assert [(name, what) for name, what, _ in log] == [
        ("a", "step"),
        ("b", "step"),
        ("a", "snapshot"),
        ("b", "snapshot"),
        ("a", "budget"),
        ("b", "budget"),
        ("a", "pool_reset"),
        ("b", "pool_reset"),
        ("b", "close"),
        ("a", "close"),
    ]
    assert log[0][2] is step and log[2][2] is SNAPSHOT and log[4][2] is BUDGET


def test_a_failing_sink_neither_raises_nor_stops_the_others(monkeypatch, log_lines) -> None:
    monkeypatch.setattr(observer_module, "FAILURE_LOG_EVERY", 3)
    log: list = []
    failing = Failing()
    hub = TelemetryHub((Recording("before", log), failing, Recording("after", log)))
    steps = sample_steps()
    for record in steps:
        hub.on_step(record)
    hub.on_snapshot(SNAPSHOT)
    hub.on_budget(BUDGET)
    hub.on_pool_reset()
    hub.close()
    assert failing.calls == len(steps) + 4
    seen = [(name, what) for name, what, _ in log]
    for what, n in (("step", len(steps)), ("snapshot", 1), ("budget", 1), ("pool_reset", 1), ("close", 1)):
        assert seen.count(("before", what)) == seen.count(("after", what)) == n, what
    # The first failure with its traceback, then one line per FAILURE_LOG_EVERY failures (here 7 in
    # all: the 3rd and the 6th).
    errors = [r for r in log_lines if r["level"].name == "ERROR"]
    warnings = [r for r in log_lines if r["level"].name == "WARNING"]
    assert len(errors) == 1 and errors[0]["exception"] is not None and "Failing" in errors[0]["message"]
    assert "on_step" in errors[0]["message"]
    assert [("3 times" in r["message"], "6 times" in r["message"]) for r in warnings] == [(True, False), (False, True)]


def test_the_shard_sinks_are_metrics_then_kv_events_then_spans(tmp_path) -> None:
    config = build_config({"model_id": str(tmp_path)}, {})
    telemetry = build_shard_telemetry(config, device=torch.device("cpu"))
    metrics, kv_events, spans = telemetry.observer.sinks
    assert isinstance(metrics, MetricsSink) and metrics.recorder is telemetry.recorder
    assert isinstance(kv_events, KVEventsSink) and kv_events.events is telemetry.kv_events
    assert isinstance(telemetry.kv_events, NullKVEvents)  # TGI_PAGED_KV_EVENTS_ENDPOINT unset
    assert isinstance(spans, SpanSink)
    telemetry.observer.close()


def test_the_metric_names_are_the_instruments_ones() -> None:
    """The instruments moved to ``instruments.py``; ``recorder.METRIC_NAMES`` is still the same table."""
    assert recorder_module.METRIC_NAMES is METRIC_NAMES


def test_span_sink_describes_only_the_routers_steps() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    step = sample_steps()[1]  # preempts two victims
    for batch_id in (None, 7):
        with tracer.start_as_current_span(f"batch {batch_id}") as span, use_span(span):
            record = step if batch_id is None else dataclasses.replace(step, batch_id=7, batch_requests=5)
            SpanSink().on_step(record)
    internal, rpc = exporter.get_finished_spans()
    assert not internal.attributes and not internal.events
    assert rpc.attributes["tgi_paged.batch.id"] == 7 and rpc.attributes["tgi_paged.batch.size"] == 5
    assert [e.name for e in rpc.events].count("tgi_paged.preemption") == 2
    provider.shutdown()


def test_builder_counts_live_requests_per_adapter() -> None:
    adapters = SimpleNamespace(names=("a", "b"), num_unknown=3)
    builder = StepRecordBuilder(clock=lambda: 100.0, adapters=adapters, max_loras=1)
    requests = [
        SimpleNamespace(adapter=1, waiting_for_adapter=False, is_waiting=False, is_preempted=False, preempted_at=None),
        SimpleNamespace(adapter=2, waiting_for_adapter=True, is_waiting=False, is_preempted=False, preempted_at=None),
        SimpleNamespace(adapter=0, waiting_for_adapter=False, is_waiting=True, is_preempted=False, preempted_at=None),
    ]
    snapshot = builder.snapshot(memory=memory_stats(), requests=iter(requests))  # iterated twice: counts, LoRA
    assert (snapshot.num_running, snapshot.num_waiting, snapshot.num_preempted) == (2, 1, 0)
    assert snapshot.lora is not None and snapshot.lora.max_loras == 1 and snapshot.lora.num_unknown == 3
    assert snapshot.lora.running == {"": 0, "a": 1, "b": 0} and snapshot.lora.waiting == {"": 1, "a": 0, "b": 1}
    assert StepRecordBuilder().snapshot(memory=memory_stats(), requests=requests).lora is None


def test_a_broken_sink_breaks_no_engine_step(tiny_llama_dir, log_lines) -> None:
    engine = make_engine(tiny_llama_dir, num_blocks=64, block_size=8)
    log: list = []
    failing = engine.observer.subscribe(Failing())
    engine.observer.subscribe(Recording("after", log))
    router_warmup(engine, 64)
    warmup_steps = [r for _, what, r in log if what == "step"]
    assert warmup_steps and all(r.batch_id is None for r in warmup_steps)
    assert any(what == "budget" for _, what, _ in log) and any(what == "pool_reset" for _, what, _ in log)
    log.clear()
    driver = RouterDriver(engine)
    batch = BatchSpec(id=3, requests=tuple(spec(i, make_text(i, 6 + i), 4) for i in range(3)))
    driver.run(batch)
    assert all(len(driver.tokens[i]) == 4 for i in range(3))  # every request finished
    steps = [r for _, what, r in log if what == "step"]
    assert len(steps) == driver.num_rpcs and all(r.batch_id == 3 for r in steps)
    assert steps[0].phase == "prefill" and steps[0].batch_requests == 3 and steps[-1] is engine.last_step
    assert all(r.lora is not None and sum(r.lora.running.values()) == r.num_running for r in steps)
    engine.prefill(LIVENESS, None)  # the router's health probe: a step of the engine's own
    assert log[-1][1] == "step" and log[-1][2].batch_id is None
    engine.clear_cache(None)
    assert log[-1][1] == "snapshot" and log[-1][2].num_running == 0
    engine.close()
    assert log[-1][1] == "close" and failing.calls > len(steps)
    assert sum(r["level"].name == "ERROR" for r in log_lines) == 1
