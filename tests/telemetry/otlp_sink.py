"""A real OTLP/gRPC receiver for the tests: the collector's Metrics and Trace services on 127.0.0.1.

Built on the service definitions shipped in ``opentelemetry-proto`` (what an OpenTelemetry Collector
implements), so the exporters under test talk to it exactly as they would to a collector.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


class OtlpSink:
    """Stores every export request it receives; ``endpoint`` is what an exporter is given."""

    def __init__(self) -> None:
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._cond = threading.Condition()
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(self), self._server)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(grace=None)

    def add(self, kind: str, request: Any) -> None:
        with self._cond:
            (self.metric_requests if kind == "metrics" else self.trace_requests).append(request)
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # -- views over what arrived ----------------------------------------------------------------

    def latest_metrics(self) -> dict[str, Any]:
        """Metric name -> the most recent ``Metric`` proto (cumulative, so the latest is the total)."""
        out: dict[str, Any] = {}
        for request in self.metric_requests:
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        out[metric.name] = metric
        return out

    def metric_resources(self) -> list[dict[str, Any]]:
        return [attributes(rm.resource.attributes) for r in self.metric_requests for rm in r.resource_metrics]

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """``(resource attributes, Span proto)`` for every span received."""
        return [
            (attributes(rs.resource.attributes), span)
            for r in self.trace_requests
            for rs in r.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, sink: OtlpSink) -> None:
        self._sink = sink

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        self._sink.add("metrics", request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink) -> None:
        self._sink = sink

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        self._sink.add("traces", request)
        return trace_service_pb2.ExportTraceServiceResponse()


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def attributes(items: list[KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in items}


def points_by(metric: Any, key: str | None = None) -> dict[Any, Any]:
    """Data points of a gauge / sum / histogram metric, keyed by one attribute's value (or ``None``)."""
    data = getattr(metric, metric.WhichOneof("data"))
    return {attributes(p.attributes).get(key) if key else None: p for p in data.data_points}
