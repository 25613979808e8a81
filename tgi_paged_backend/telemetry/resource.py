"""The OpenTelemetry resource that identifies one shard (shared by metrics and traces)."""

from __future__ import annotations

import socket

from opentelemetry.sdk.resources import Resource

from tgi_paged_backend.config import TelemetryConfig

SHARD_RANK_ATTRIBUTE = "tgi_paged.shard.rank"
"""Resource attribute carrying the shard rank."""


def shard_attributes(config: TelemetryConfig, rank: int) -> dict[str, str | int]:
    """``service.name`` (``--otlp-service-name``), ``service.instance.id`` (``{host}-rank{rank}``,
    Prometheus' ``instance`` behind a Collector) and the rank."""
    return {
        "service.name": config.otlp_service_name,
        "service.instance.id": f"{socket.gethostname()}-rank{rank}",
        SHARD_RANK_ATTRIBUTE: rank,
    }


def shard_resource(config: TelemetryConfig, rank: int) -> Resource:
    """:func:`shard_attributes` over the SDK defaults and ``OTEL_RESOURCE_ATTRIBUTES`` (ours win)."""
    return Resource.create(shard_attributes(config, rank))
