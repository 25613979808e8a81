"""Step details on the RPC's span: attributes for sizes, one event per preemption and per swap.

Uses only ``opentelemetry-api`` (no provider): when tracing is off the current span is the API's
non-recording span and every call below is a cheap no-op. :class:`~.sinks.SpanSink` calls
``annotate_step(trace.get_current_span(), ...)`` for each Prefill and Decode step, on the engine's worker
thread: the servicer copies the RPC's context there, so the current span is the RPC's server span.
"""

from __future__ import annotations

from opentelemetry.trace import Span

from tgi_paged_backend.telemetry.step_record import StepRecord

_INT64_MAX = 2**63 - 1


def annotate_step(span: Span, record: StepRecord, batch_id: int | None, num_requests: int) -> None:
    """Describe one engine step on ``span``.

    Args:
        span: Usually the RPC span (``opentelemetry.trace.get_current_span()``).
        record: The step.
        batch_id: The (cached) batch id the step ran for; ``None`` for internal steps.
        num_requests: Requests in the batch, preempted ones included (``batch_size`` in ``record``
            counts only the ones computed).
    """
    if not span.is_recording():
        return
    attributes: dict[str, int | float | str] = {
        "tgi_paged.batch.size": num_requests,
        "tgi_paged.step.phase": record.phase,
        "tgi_paged.step.batch_size": record.batch_size,
        "tgi_paged.step.tokens_computed": record.tokens_computed,
        "tgi_paged.step.tokens_recomputed": record.tokens_recomputed,
        "tgi_paged.step.blocks_allocated": record.blocks_allocated,
        "tgi_paged.step.preemptions": len(record.preemptions),
        "tgi_paged.step.swap_out_bytes": record.swap_out_bytes,
        "tgi_paged.step.swap_in_bytes": record.swap_in_bytes,
        "tgi_paged.step.seconds": record.step_s,
        "tgi_paged.kv.free_blocks": record.memory.num_free_blocks,
        "tgi_paged.kv.usage_ratio": record.memory.usage_ratio,
        "tgi_paged.requests.preempted": record.num_preempted,
    }
    if batch_id is not None:
        attributes["tgi_paged.batch.id"] = _id(batch_id)
    span.set_attributes(attributes)
    for event in record.preemptions:
        span.add_event(
            "tgi_paged.preemption",
            {
                "tgi_paged.preemption.mode": event.mode,
                "tgi_paged.preemption.victim_id": _id(event.victim_id),
                "tgi_paged.preemption.tokens_lost": event.tokens_lost,
                "tgi_paged.preemption.estimated_cost_s": event.estimated_cost_s,
            },
        )
    if record.swap_out_bytes or record.swap_in_bytes:
        span.add_event(
            "tgi_paged.swap",
            {
                "tgi_paged.swap.out_bytes": record.swap_out_bytes,
                "tgi_paged.swap.in_bytes": record.swap_in_bytes,
            },
        )
    if record.resumed_wait_s:
        span.add_event(
            "tgi_paged.resume",
            {
                "tgi_paged.resume.count": len(record.resumed_wait_s),
                "tgi_paged.resume.max_wait_s": max(record.resumed_wait_s),
            },
        )


def _id(value: int) -> int | str:
    """Router ids are u64; OTLP integers are int64 (``U64_MAX``, the liveness batch id, would break export)."""
    return value if 0 <= value <= _INT64_MAX else str(value)
