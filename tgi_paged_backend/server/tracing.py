"""Server-side tracing: one SERVER span per RPC, child of the router's W3C ``traceparent``.

- :func:`setup_tracing` builds a private ``TracerProvider`` (the global one is never set) exporting
  OTLP/gRPC through a ``BatchSpanProcessor``, or returns ``None`` when no endpoint is configured.
  Standard ``OTEL_EXPORTER_OTLP_*`` variables (headers, timeout) are honoured by the exporter.
- :class:`TracingInterceptor` (a ``grpc.aio.ServerInterceptor``) opens the span around each unary
  call. The router injects ``traceparent`` into every call's metadata; it is extracted with the
  W3C TraceContext propagator, so server spans nest under the router's client spans. Without it
  the span is a root. The span is current while the servicer runs (and in its worker thread: the
  servicer copies the context), so the engine can add step details with :func:`annotate_step`.
  It never calls ``context.peer()`` (which breaks on unix sockets, the stock server's workaround).
- With a ``None`` provider the interceptor passes calls through untouched.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tgi_paged_backend.config import TelemetryConfig
from tgi_paged_backend.telemetry.resource import shard_resource
from tgi_paged_backend.telemetry.spans import annotate_step

__all__ = ["TracingInterceptor", "annotate_step", "setup_tracing"]

INSTRUMENTATION_NAME = "tgi_paged_backend.server"


def setup_tracing(config: TelemetryConfig, rank: int = 0) -> TracerProvider | None:
    """A provider exporting spans to ``config.otlp_endpoint`` over OTLP/gRPC, or ``None`` when unset.

    The caller owns it: ``provider.shutdown()`` at exit flushes the last spans.
    """
    if config.otlp_endpoint is None:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=shard_resource(config, rank))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=True)))
    return provider


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps unary-unary handlers (all ``generate.v3`` RPCs) in a span; streams pass through untraced."""

    def __init__(self, tracer_provider: TracerProvider | None) -> None:
        self._tracer = None if tracer_provider is None else tracer_provider.get_tracer(INSTRUMENTATION_NAME)
        self._propagator = TraceContextTextMapPropagator()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if self._tracer is None or handler is None or handler.unary_unary is None:
            return handler
        behavior = self._traced(
            handler.unary_unary, handler_call_details.method, handler_call_details.invocation_metadata
        )
        return grpc.unary_unary_rpc_method_handler(
            behavior, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    def _traced(self, inner: Callable[..., Any], method: str, metadata: Sequence[Any] | None):
        name = method.lstrip("/")  # "generate.v3.TextGenerationService/Prefill"
        service, _, rpc = name.rpartition("/")
        tracer = self._tracer
        assert tracer is not None

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            parent = self._propagator.extract(_carrier(metadata))
            attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}
            with tracer.start_as_current_span(
                name,
                context=parent,
                kind=SpanKind.SERVER,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                try:
                    response = inner(request, context)
                    if inspect.isawaitable(response):
                        response = await response
                except asyncio.CancelledError:
                    _set_grpc_status(span, grpc.StatusCode.CANCELLED, "cancelled")
                    raise
                except Exception as err:
                    code = _context_code(context)
                    if code is None or code is grpc.StatusCode.OK:  # raised without abort: grpc answers UNKNOWN
                        code = grpc.StatusCode.UNKNOWN
                        span.record_exception(err)
                    _set_grpc_status(span, code, _context_details(context) or str(err) or type(err).__name__)
                    raise
                code = _context_code(context) or grpc.StatusCode.OK
                _set_grpc_status(span, code, _context_details(context))
                return response

        return behavior


def _carrier(metadata: Sequence[Any] | None) -> Mapping[str, str]:
    """gRPC invocation metadata (``(key, value)`` pairs, keys lower-case) -> propagator carrier."""
    carrier: dict[str, str] = {}
    for item in metadata or ():
        key, value = item[0], item[1]
        if isinstance(value, str):
            carrier[key.lower()] = value
    return carrier


def _set_grpc_status(span: Any, code: grpc.StatusCode, description: str | None) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {description}" if description else code.name))


def _context_code(context: Any) -> grpc.StatusCode | None:
    code = getattr(context, "code", None)
    try:
        value = code() if callable(code) else None
    except Exception:  # noqa: BLE001 - older grpc.aio contexts may not support it
        return None
    if isinstance(value, int):
        return next((c for c in grpc.StatusCode if c.value[0] == value), None)
    return value if isinstance(value, grpc.StatusCode) else None


def _context_details(context: Any) -> str | None:
    details = getattr(context, "details", None)
    try:
        value = details() if callable(details) else None
    except Exception:  # noqa: BLE001
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value or None
