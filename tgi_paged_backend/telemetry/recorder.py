"""Metric recorders: the metrics sink (:class:`~.sinks.MetricsSink`) calls one per step; implementations turn
records into instruments.

:func:`build_recorder` picks the implementation from :class:`TelemetryConfig`:

- :class:`OtelRecorder` when ``otlp_endpoint`` and/or ``metrics_port`` is set. It owns a private
  ``MeterProvider`` (the global one is never read or set) with the ``tgi_paged_*`` instruments of
  ``docs/design.md`` (see :data:`METRIC_NAMES`; the instruments are made in :mod:`.instruments`) and up
  to two readers: periodic OTLP/gRPC push, and a Prometheus ``/metrics`` endpoint on
  ``127.0.0.1:{metrics_port + rank}`` (one port per shard).
- :class:`NullRecorder` otherwise.

Either way the result is wrapped in :class:`PreemptionLoggingRecorder`, so preemption summaries reach
the log (rate-limited) even with metrics off.

Gauges are observable: their callbacks read the latest snapshot, so an exporter thread never calls
into the engine. Counters and histograms are fed from each record's per-step deltas.
"""

from __future__ import annotations

import time
from typing import Protocol

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader

from tgi_paged_backend.config import TelemetryConfig
from tgi_paged_backend.memory.stats import MemoryStats
from tgi_paged_backend.telemetry.instruments import METER_NAME, METRIC_NAMES, OtelInstruments, views
from tgi_paged_backend.telemetry.log_throttle import PreemptionLogThrottle
from tgi_paged_backend.telemetry.lora_usage import LoraUsage
from tgi_paged_backend.telemetry.prometheus import PrometheusEndpoint
from tgi_paged_backend.telemetry.resource import shard_attributes, shard_resource
from tgi_paged_backend.telemetry.step_record import MemoryBudget, StepRecord

__all__ = [
    "METRIC_NAMES",
    "MetricsRecorder",
    "NullRecorder",
    "OtelRecorder",
    "PreemptionLoggingRecorder",
    "build_recorder",
]


class MetricsRecorder(Protocol):
    """What the metrics sink calls. Implementations must be cheap: ``record_step`` runs on every step."""

    def record_step(self, record: StepRecord) -> None: ...

    def record_memory(
        self,
        memory: MemoryStats,
        *,
        num_running: int,
        num_preempted: int,
        max_preempted_wait_s: float = 0.0,
        num_waiting: int = 0,
    ) -> None:
        """Refresh the pool gauges outside a step (after FilterBatch / ClearCache freed blocks)."""

    def record_budget(self, budget: MemoryBudget) -> None: ...

    def record_lora(self, usage: LoraUsage) -> None:
        """Refresh the LoRA gauges (after every step and RPC that changes the live requests)."""

    def shutdown(self) -> None: ...


class NullRecorder:
    """Records nothing."""

    def record_step(self, record: StepRecord) -> None:
        pass

    def record_memory(
        self,
        memory: MemoryStats,
        *,
        num_running: int,
        num_preempted: int,
        max_preempted_wait_s: float = 0.0,
        num_waiting: int = 0,
    ) -> None:
        pass

    def record_budget(self, budget: MemoryBudget) -> None:
        pass

    def record_lora(self, usage: LoraUsage) -> None:
        pass

    def shutdown(self) -> None:
        pass


class PreemptionLoggingRecorder:
    """Logs rate-limited preemption summaries, then forwards everything to ``inner``."""

    def __init__(self, inner: MetricsRecorder, throttle: PreemptionLogThrottle | None = None) -> None:
        self.inner = inner
        self.throttle = throttle if throttle is not None else PreemptionLogThrottle()

    def record_step(self, record: StepRecord) -> None:
        self.throttle.observe(record.preemptions)
        self.inner.record_step(record)

    def record_memory(
        self,
        memory: MemoryStats,
        *,
        num_running: int,
        num_preempted: int,
        max_preempted_wait_s: float = 0.0,
        num_waiting: int = 0,
    ) -> None:
        self.inner.record_memory(
            memory,
            num_running=num_running,
            num_preempted=num_preempted,
            max_preempted_wait_s=max_preempted_wait_s,
            num_waiting=num_waiting,
        )

    def record_budget(self, budget: MemoryBudget) -> None:
        self.inner.record_budget(budget)

    def record_lora(self, usage: LoraUsage) -> None:
        self.inner.record_lora(usage)

    def shutdown(self) -> None:
        self.throttle.flush()
        self.inner.shutdown()


def build_recorder(config: TelemetryConfig, rank: int = 0) -> MetricsRecorder:
    """The recorder a shard should use for ``config`` (see the module docstring)."""
    exporting = config.otlp_endpoint is not None or config.metrics_port is not None
    inner: MetricsRecorder = OtelRecorder(config, rank) if exporting else NullRecorder()
    return PreemptionLoggingRecorder(inner)


class OtelRecorder(OtelInstruments):
    """OpenTelemetry instruments on a private ``MeterProvider``.

    Args:
        config: ``otlp_endpoint`` enables OTLP/gRPC push (``insecure=True``, interval from
            ``export_interval_s`` or ``OTEL_METRIC_EXPORT_INTERVAL``, default 60 s);
            ``metrics_port`` enables ``/metrics`` on ``127.0.0.1:{metrics_port + rank}``
            (``metrics_port=0``: any free port, see :attr:`metrics_port`).
        rank: Shard rank, a resource attribute.
        export_interval_s: Override of the OTLP push interval.
    """

    def __init__(self, config: TelemetryConfig, rank: int = 0, *, export_interval_s: float | None = None) -> None:
        self.resource = shard_resource(config, rank)
        readers: list[MetricReader] = []
        if config.otlp_endpoint is not None:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            interval_ms = None if export_interval_s is None else export_interval_s * 1000
            readers.append(
                PeriodicExportingMetricReader(
                    OTLPMetricExporter(endpoint=config.otlp_endpoint, insecure=True), export_interval_millis=interval_ms
                )
            )
        self.prometheus: PrometheusEndpoint | None = None
        if config.metrics_port is not None:
            port = config.metrics_port + rank if config.metrics_port else 0
            if port > 65535:
                raise OSError(
                    f"cannot serve Prometheus metrics on port {config.metrics_port} + rank {rank} = {port}: "
                    "choose a lower TGI_PAGED_METRICS_PORT"
                )
            self.prometheus = PrometheusEndpoint(
                host=config.metrics_host, port=port, target_info=shard_attributes(config, rank)
            )
            readers.append(self.prometheus)
        self.provider = MeterProvider(resource=self.resource, metric_readers=readers, views=views())
        self._memory: MemoryStats | None = None
        self._requests = (0, 0, 0.0, 0)
        self._budget: MemoryBudget | None = None
        self._lora = LoraUsage(0, {"": 0}, {"": 0}, 0, time.time())
        self._closed = False
        self._create_instruments(self.provider.get_meter(METER_NAME))
        if self.prometheus is not None:
            try:
                self.prometheus.start()
            except OSError as err:
                self.provider.shutdown()
                raise OSError(
                    f"cannot serve Prometheus metrics on {config.metrics_host}:{self.prometheus.port} "
                    f"(TGI_PAGED_METRICS_PORT + rank): {err}"
                ) from err

    @property
    def metrics_port(self) -> int | None:
        """The bound ``/metrics`` port, or ``None`` when the endpoint is off."""
        return None if self.prometheus is None else self.prometheus.port

    # -- MetricsRecorder ---------------------------------------------------------------------

    def record_step(self, record: StepRecord) -> None:
        self._memory = record.memory
        if record.tiers is not None:
            self._tiers = record.tiers
        self._requests = (record.num_running, record.num_preempted, record.max_preempted_wait_s, record.num_waiting)
        if record.batch_size:
            self._step_seconds.record(record.step_s, self._phase_attrs[record.phase])
            part_attrs = self._part_attrs[record.phase]
            for part, seconds in record.part_s:
                self._step_part_seconds.record(seconds, part_attrs[part])
            self._batch_size.record(record.batch_size)
        for event in record.preemptions:
            self._preemptions.add(1, self._mode_attrs.get(event.mode) or {"mode": event.mode})
        for waited in record.resumed_wait_s:
            self._preempted_wait.record(waited)
        if record.tokens_computed:
            self._computed.add(record.tokens_computed)
        if record.tokens_recomputed:
            self._recomputed.add(record.tokens_recomputed)
        if record.swap_out_bytes:
            self._swap_bytes.add(record.swap_out_bytes, self._direction_attrs["out"])
        if record.swap_in_bytes:
            self._swap_bytes.add(record.swap_in_bytes, self._direction_attrs["in"])
        if record.prefix_query_tokens:
            self._prefix_query.add(record.prefix_query_tokens)
        if record.prefix_hit_tokens:
            self._prefix_hit.add(record.prefix_hit_tokens)
        if record.image_tokens:
            self._image_tokens.add(record.image_tokens)
        if record.images_encoded:
            self._images_encoded.add(record.images_encoded)
        for seconds in record.grammar_compile_s:
            self._grammar_compile.record(seconds)
        if record.grammar_cache_hits:
            self._grammar_hits.add(record.grammar_cache_hits)
        if record.constrained_rows:
            self._constrained_rows.record(record.constrained_rows)
        if record.draft_tokens:
            self._spec_drafts.add(record.draft_tokens)
            self._spec_accepted.add(record.accepted_draft_tokens)
            drafted, accepted = self._spec_totals
            self._spec_totals = (drafted + record.draft_tokens, accepted + record.accepted_draft_tokens)

    def record_memory(
        self,
        memory: MemoryStats,
        *,
        num_running: int,
        num_preempted: int,
        max_preempted_wait_s: float = 0.0,
        num_waiting: int = 0,
    ) -> None:
        self._memory = memory
        self._requests = (num_running, num_preempted, max_preempted_wait_s, num_waiting)

    def record_budget(self, budget: MemoryBudget) -> None:
        self._budget = budget

    def record_lora(self, usage: LoraUsage) -> None:
        unknown = usage.num_unknown - self._lora.num_unknown
        if unknown > 0:
            self._lora_unknown.add(unknown)
        self._lora = usage

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Push pending metrics now (OTLP); returns False on timeout."""
        return self.provider.force_flush(timeout_millis=int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Final OTLP export, stop the ``/metrics`` server. Idempotent."""
        if not self._closed:
            self._closed = True
            self.provider.shutdown()
