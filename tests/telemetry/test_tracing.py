"""The tracing interceptor on a real grpc.aio server (unix socket) with the project's servicer.

Spans go through a real OTLP/gRPC exporter to the test's receiver; the test checks the parent link
to the ``traceparent`` it sent, the span name and RPC attributes, and the step details that
``annotate_step`` added from the engine's worker thread.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.proto.trace.v1.trace_pb2 import Status as StatusProto
from otlp_sink import OtlpSink, attributes
from telemetry_samples import sample_steps

from tgi_paged_backend.config import TelemetryConfig
from tgi_paged_backend.engine.types import BatchNotFoundError, InfoResult, StepResult
from tgi_paged_backend.server.pb import generate_pb2 as pb
from tgi_paged_backend.server.pb import generate_pb2_grpc as pb_grpc
from tgi_paged_backend.server.servicer import TextGenerationService
from tgi_paged_backend.server.tracing import TracingInterceptor, annotate_step, setup_tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
STEP = sample_steps()[1]  # two preemptions, swap-out


class AnnotatingEngine:
    """Just enough of a ShardEngine: Prefill annotates the current span the way the engine will."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def info(self) -> InfoResult:
        return InfoResult(
            requires_padding=False,
            dtype="float32",
            device_type="cpu",
            window_size=None,
            speculate=0,
            support_chunking=True,
            use_prefix_caching=False,
            attention_impl="paged",
            block_size=16,
        )

    def prefill(self, batch, cached_batch_id):
        self.threads.append(threading.current_thread().name)
        annotate_step(trace.get_current_span(), STEP, batch.id, len(batch.requests))
        return StepResult(generations=[], batch=None, forward_ns=1, decode_ns=1)

    def decode(self, batch_ids):
        raise BatchNotFoundError(f"Batch ID {batch_ids[0]} not found in cache.")


class Shard:
    """grpc.aio server with the interceptor on its own thread and loop, as grpc_server.serve runs it."""

    def __init__(self, socket_path: Path, interceptor: TracingInterceptor, engine: AnnotatingEngine) -> None:
        self.socket_path = socket_path
        self._interceptor, self._engine = interceptor, engine
        self._ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tgi-engine")
        server = grpc.aio.server(interceptors=[self._interceptor])
        pb_grpc.add_TextGenerationServiceServicer_to_server(
            TextGenerationService(self._engine, [f"unix://{self.socket_path}"], executor), server
        )
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._ready.set()
        await self._stop.wait()
        await server.stop(None)
        executor.shutdown(wait=False)

    def __enter__(self) -> pb_grpc.TextGenerationServiceStub:
        self._thread.start()
        assert self._ready.wait(10)
        self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
        return pb_grpc.TextGenerationServiceStub(self._channel)

    def __exit__(self, *exc: object) -> None:
        self._channel.close()
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def _prefill_request(batch_id: int = 42) -> pb.PrefillRequest:
    request = pb.Request(id=5, inputs="hello", stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1))
    return pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=[request], size=1))


def _spans_named(sink: OtlpSink, name: str) -> list[tuple[dict, SpanProto]]:
    return [(res, s) for res, s in sink.spans() if s.name == name]


@pytest.fixture
def provider(otlp_sink: OtlpSink):
    provider = setup_tracing(
        TelemetryConfig(otlp_endpoint=otlp_sink.endpoint, otlp_service_name="tgi-trace-test"), rank=0
    )
    assert provider is not None
    yield provider
    provider.shutdown()


def test_rpc_span_is_child_of_router_traceparent_with_step_details(provider, otlp_sink, short_dir) -> None:
    engine = AnnotatingEngine()
    with Shard(short_dir / "shard-0", TracingInterceptor(provider), engine) as stub:
        stub.Prefill(_prefill_request(), metadata=[("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01")])
    assert provider.force_flush()
    assert otlp_sink.wait_for(lambda: bool(_spans_named(otlp_sink, "generate.v3.TextGenerationService/Prefill")))

    ((resource, span),) = _spans_named(otlp_sink, "generate.v3.TextGenerationService/Prefill")
    assert engine.threads and engine.threads[0].startswith("tgi-engine")  # annotated from the worker thread
    assert span.trace_id.hex() == TRACE_ID
    assert span.parent_span_id.hex() == PARENT_SPAN_ID
    assert span.kind == SpanProto.SPAN_KIND_SERVER
    assert resource["service.name"] == "tgi-trace-test" and resource["tgi_paged.shard.rank"] == 0
    attrs = attributes(span.attributes)
    assert attrs["rpc.system"] == "grpc"
    assert attrs["rpc.service"] == "generate.v3.TextGenerationService"
    assert attrs["rpc.method"] == "Prefill"
    assert attrs["rpc.grpc.status_code"] == 0
    assert attrs["tgi_paged.batch.id"] == 42
    assert attrs["tgi_paged.batch.size"] == 1
    assert attrs["tgi_paged.step.batch_size"] == STEP.batch_size
    assert attrs["tgi_paged.step.tokens_computed"] == STEP.tokens_computed
    assert attrs["tgi_paged.step.blocks_allocated"] == STEP.blocks_allocated
    assert attrs["tgi_paged.step.swap_out_bytes"] == 8192
    preemptions = [attributes(e.attributes) for e in span.events if e.name == "tgi_paged.preemption"]
    assert preemptions == [
        {
            "tgi_paged.preemption.mode": "recompute",
            "tgi_paged.preemption.victim_id": 11,
            "tgi_paged.preemption.tokens_lost": 40,
            "tgi_paged.preemption.estimated_cost_s": 0.02,
        },
        {
            "tgi_paged.preemption.mode": "swap",
            "tgi_paged.preemption.victim_id": 12,
            "tgi_paged.preemption.tokens_lost": 64,
            "tgi_paged.preemption.estimated_cost_s": 0.004,
        },
    ]
    (swap,) = [attributes(e.attributes) for e in span.events if e.name == "tgi_paged.swap"]
    assert swap == {"tgi_paged.swap.out_bytes": 8192, "tgi_paged.swap.in_bytes": 0}


def test_without_traceparent_the_span_is_a_root_and_errors_carry_the_grpc_status(
    provider, otlp_sink, short_dir
) -> None:
    with Shard(short_dir / "shard-0", TracingInterceptor(provider), AnnotatingEngine()) as stub:
        stub.Info(pb.InfoRequest())
        with pytest.raises(grpc.RpcError) as err:
            stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=7)]))
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert provider.force_flush()
    assert otlp_sink.wait_for(lambda: len(otlp_sink.spans()) >= 2)

    ((_, info),) = _spans_named(otlp_sink, "generate.v3.TextGenerationService/Info")
    assert info.parent_span_id == b"" and len(info.trace_id) == 16
    assert attributes(info.attributes)["rpc.grpc.status_code"] == 0
    ((_, decode),) = _spans_named(otlp_sink, "generate.v3.TextGenerationService/Decode")
    assert decode.trace_id != info.trace_id  # two separate roots
    assert attributes(decode.attributes)["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert decode.status.code == StatusProto.STATUS_CODE_ERROR
    assert "Batch ID 7 not found" in decode.status.message


def test_tracing_off_passes_calls_through(otlp_sink, short_dir) -> None:
    assert setup_tracing(TelemetryConfig(otlp_endpoint=None)) is None
    engine = AnnotatingEngine()
    with Shard(short_dir / "shard-0", TracingInterceptor(None), engine) as stub:
        stub.Prefill(_prefill_request(), metadata=[("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01")])
    assert engine.threads  # the call ran, annotate_step was a no-op on the non-recording span
    assert otlp_sink.trace_requests == []
    assert not trace.get_current_span().is_recording()


def test_annotate_step_keeps_u64_ids_exportable(provider, otlp_sink) -> None:
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("liveness") as span:
        annotate_step(span, STEP, 2**64 - 1, 1)
    assert provider.force_flush()
    assert otlp_sink.wait_for(lambda: bool(_spans_named(otlp_sink, "liveness")))
    ((_, exported),) = _spans_named(otlp_sink, "liveness")
    assert attributes(exported.attributes)["tgi_paged.batch.id"] == str(2**64 - 1)
