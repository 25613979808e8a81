"""A pull-mode OpenTelemetry reader that serves the Prometheus text format on 127.0.0.1.

Why not ``opentelemetry-exporter-prometheus``: its reader registers with prometheus_client's global
``REGISTRY`` (a private registry is only accepted by releases from 2026 on), and its metric names
depend on its version (unit and ``_total`` suffixing changed across releases). This reader is small,
keeps its own ``CollectorRegistry`` and HTTP server (two recorders in one process never collide), and
exports each instrument under exactly its OpenTelemetry name -- the instrument names already end in
their unit (``_seconds``, ``_bytes``, ``_ratio``) and counters in ``_total``, so the names match what
an OpenTelemetry Collector's Prometheus exporter produces from the same data over OTLP.

Each scrape of ``/metrics`` runs one collection (observable-gauge callbacks included), so values are
as fresh as the scrape.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from http.server import ThreadingHTTPServer
from typing import Any

from opentelemetry.sdk.metrics.export import Gauge, Histogram, MetricReader, MetricsData, Sum
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import MetricsHandler
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString


class PrometheusEndpoint(MetricReader):
    """Serves ``http://{host}:{port}/metrics`` from a private registry; ``port=0`` picks a free port.

    The server starts in :meth:`start` (after the reader is attached to a ``MeterProvider``) and stops
    in :meth:`shutdown`, which the provider's shutdown calls.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, target_info: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.host = host
        self._requested_port = port
        self._target_info = {_label_name(k): str(v) for k, v in (target_info or {}).items()}
        self._collect_lock = threading.Lock()
        self._latest: MetricsData | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the requested one, or the one the OS picked for 0)."""
        if self._server is None:
            return self._requested_port
        return self._server.server_address[1]

    def start(self) -> None:
        """Bind and serve in a daemon thread (raises ``OSError`` when the port is taken)."""
        if self._server is not None:
            return
        server = ThreadingHTTPServer((self.host, self._requested_port), MetricsHandler.factory(self.registry))
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"tgi-paged-metrics-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def render(self) -> bytes:
        """The text exposition a scrape would return now."""
        return generate_latest(self.registry)

    def families(self) -> list[Metric]:
        """Collect now and translate; called by the registry on every scrape."""
        with self._collect_lock:
            self._latest = None
            self.collect()
            data, self._latest = self._latest, None
        families: list[Metric] = []
        if self._target_info:
            info = InfoMetricFamily("target", "Resource attributes of this shard", labels=list(self._target_info))
            info.add_metric(list(self._target_info), self._target_info)
            families.append(info)
        if data is not None:
            families.extend(_translate(data))
        return families

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        self._latest = metrics_data

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=timeout_millis / 1000)
            self._thread = None


class _Collector:
    """prometheus_client collector protocol (``collect``) over a :class:`PrometheusEndpoint`."""

    def __init__(self, endpoint: PrometheusEndpoint) -> None:
        self._endpoint = endpoint

    def collect(self) -> Iterator[Metric]:
        yield from self._endpoint.families()


def _translate(data: MetricsData) -> Iterator[Metric]:
    for resource_metrics in data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                family = _family(metric.name, metric.description or metric.name, metric.data)
                if family is not None:
                    yield family


def _family(name: str, help_text: str, data: Any) -> Metric | None:
    points = list(data.data_points)
    keys = sorted({_label_name(k) for p in points for k in (p.attributes or {})})

    def labels(point: Any) -> list[str]:
        attrs = {_label_name(k): str(v) for k, v in (point.attributes or {}).items()}
        return [attrs.get(k, "") for k in keys]

    if isinstance(data, Histogram):
        histogram = HistogramMetricFamily(name, help_text, labels=keys)
        for p in points:
            cumulative, buckets = 0, []
            # bucket_counts has one more entry (the overflow bucket) than explicit_bounds: +Inf below
            for bound, count in zip(p.explicit_bounds, p.bucket_counts, strict=False):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            buckets.append(("+Inf", p.count))
            histogram.add_metric(labels(p), buckets, p.sum)
        return histogram
    family: CounterMetricFamily | GaugeMetricFamily
    if isinstance(data, Sum) and data.is_monotonic:
        family = CounterMetricFamily(name, help_text, labels=keys)
    elif isinstance(data, (Sum, Gauge)):
        family = GaugeMetricFamily(name, help_text, labels=keys)
    else:
        return None
    for p in points:
        family.add_metric(labels(p), p.value)
    return family


def _label_name(key: str) -> str:
    """OpenTelemetry attribute key -> Prometheus label name (``service.name`` -> ``service_name``)."""
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in key)
    return f"_{out}" if out[:1].isdigit() else out
