"""A shard's telemetry sinks and how they are wired to the engine's one observer.

:func:`build_shard_telemetry` is called where the engine is built (``engine.build_engine``, the
tensor-parallel builder): it makes the sinks the config asks for and subscribes them, in this order,
to a :class:`~.observer.TelemetryHub`:

1. :class:`MetricsSink`: the metrics recorder (``build_recorder``: OpenTelemetry instruments, or
   none, behind the rate-limited preemption log) and its LoRA gauges;
2. :class:`KVEventsSink`: ends each step's batch of KV-cache events (``build_kv_events``);
3. :class:`SpanSink`: the step's details on the RPC's span (``annotate_step``).

To add a sink, subclass :class:`~.observer.TelemetrySink` and subscribe it here (or to
``engine.observer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace

from tgi_paged_backend.telemetry.kv_events import KVEventSink, build_kv_events
from tgi_paged_backend.telemetry.observer import TelemetryHub, TelemetrySink
from tgi_paged_backend.telemetry.recorder import MetricsRecorder, build_recorder
from tgi_paged_backend.telemetry.spans import annotate_step
from tgi_paged_backend.telemetry.step_record import MemoryBudget, SnapshotRecord, StepRecord

if TYPE_CHECKING:
    import torch

    from tgi_paged_backend.config import BackendConfig


class MetricsSink(TelemetrySink):
    """Feeds a :class:`~.recorder.MetricsRecorder`: the step's counters and gauges, then its LoRA usage."""

    def __init__(self, recorder: MetricsRecorder) -> None:
        self.recorder = recorder

    def on_step(self, record: StepRecord) -> None:
        self.recorder.record_step(record)
        if record.lora is not None:
            self.recorder.record_lora(record.lora)

    def on_snapshot(self, record: SnapshotRecord) -> None:
        self.recorder.record_memory(
            record.memory,
            num_running=record.num_running,
            num_preempted=record.num_preempted,
            num_waiting=record.num_waiting,
        )
        if record.lora is not None:
            self.recorder.record_lora(record.lora)

    def on_budget(self, budget: MemoryBudget) -> None:
        self.recorder.record_budget(budget)

    def close(self) -> None:
        self.recorder.shutdown()


class KVEventsSink(TelemetrySink):
    """Ends the batch of KV-cache events the prefix cache reported since the last report (one batch per
    step or RPC); a new pool clears every block the subscriber holds."""

    def __init__(self, events: KVEventSink) -> None:
        self.events = events

    def on_step(self, record: StepRecord) -> None:
        self.events.flush()

    def on_snapshot(self, record: SnapshotRecord) -> None:
        self.events.flush()

    def on_pool_reset(self) -> None:
        self.events.all_cleared()
        self.events.flush()

    def close(self) -> None:
        self.events.close()


class SpanSink(TelemetrySink):
    """Describes the steps the router asked for (Prefill, Decode) on the current span, the RPC's."""

    def on_step(self, record: StepRecord) -> None:
        if record.batch_id is not None:
            annotate_step(trace.get_current_span(), record, record.batch_id, record.batch_requests)


@dataclass(frozen=True, slots=True)
class ShardTelemetry:
    """What the engine is given: the observer it reports to, and the two sinks' objects it also hands on."""

    observer: TelemetryHub
    """The one observer of every step (the sinks are subscribed to it)."""
    kv_events: KVEventSink
    """KV-cache events (``TGI_PAGED_KV_EVENTS_ENDPOINT``; rank 0), else a no-op: the memory manager's
    observer too, as the prefix cache stores and removes blocks."""
    recorder: MetricsRecorder
    """The metrics recorder behind :class:`MetricsSink` (for callers that read or wrap it)."""


def build_shard_telemetry(
    config: BackendConfig, *, device: torch.device, adapter_names: tuple[str, ...] = ()
) -> ShardTelemetry:
    """The sinks ``config`` asks for, subscribed to one observer (order: metrics, KV events, spans)."""
    recorder = build_recorder(config.telemetry, config.server.rank)
    kv_events = build_kv_events(config, config.cache.block_size, device, adapter_names)
    hub = TelemetryHub((MetricsSink(recorder), KVEventsSink(kv_events), SpanSink()))
    return ShardTelemetry(observer=hub, kv_events=kv_events, recorder=recorder)
