"""One observer of the engine: the engine reports to a :class:`TelemetryHub`, the sinks subscribe to it.

The engine builds one :class:`~.step_record.StepRecord` per step and hands it to the hub
(:meth:`TelemetryHub.on_step`); between steps it reports the pool and the live requests after an RPC
freed some (:meth:`~TelemetryHub.on_snapshot`), the memory split at each sizing
(:meth:`~TelemetryHub.on_budget`) and a rebuilt pool (:meth:`~TelemetryHub.on_pool_reset`). The hub
passes each report to its sinks in the order they subscribed; the engine never sees the list. Which
sinks a shard has is decided where the engine is built (:func:`~.sinks.build_shard_telemetry`).

A sink that raises never breaks the step: the hub logs its first failure with the traceback, counts
the rest (a line every :data:`FAILURE_LOG_EVERY`), and the other sinks still get the report.
"""

from __future__ import annotations

from typing import TypeVar

from loguru import logger

from tgi_paged_backend.telemetry.step_record import MemoryBudget, SnapshotRecord, StepRecord

FAILURE_LOG_EVERY = 1000
"""After a sink's first failure (logged with its traceback), one line per this many more."""


class TelemetrySink:
    """The protocol a sink implements: override what it needs; every report defaults to a no-op.

    Reports run on the engine's thread, inside the step's ``telemetry`` part: keep them cheap."""

    def on_step(self, record: StepRecord) -> None:
        """One engine step (every step, Warmup's and the liveness probe's included)."""

    def on_snapshot(self, record: SnapshotRecord) -> None:
        """The pool and the live requests after an RPC freed requests outside a step."""

    def on_budget(self, budget: MemoryBudget) -> None:
        """How device memory was split when the pool was sized (Warmup)."""

    def on_pool_reset(self) -> None:
        """A new pool replaced the old one: every block it held or retained is gone."""

    def close(self) -> None:
        """Flush and stop (the shard is shutting down)."""


SinkT = TypeVar("SinkT", bound=TelemetrySink)


class TelemetryHub(TelemetrySink):
    """The engine's one observer: forwards every report to each subscribed sink, in subscription order
    (:meth:`close` in reverse order); a sink that raises is logged and skipped, never re-raised."""

    def __init__(self, sinks: tuple[TelemetrySink, ...] = ()) -> None:
        self._sinks: list[TelemetrySink] = []
        self._failures: dict[int, int] = {}
        for sink in sinks:
            self.subscribe(sink)

    def subscribe(self, sink: SinkT) -> SinkT:
        """Add ``sink`` after the others; returns it."""
        self._sinks.append(sink)
        return sink

    @property
    def sinks(self) -> tuple[TelemetrySink, ...]:
        """The subscribed sinks, in order."""
        return tuple(self._sinks)

    def on_step(self, record: StepRecord) -> None:
        for sink in self._sinks:
            try:
                sink.on_step(record)
            except Exception as err:  # noqa: BLE001 - a sink must not break the step
                self._failed(sink, "on_step", err)

    def on_snapshot(self, record: SnapshotRecord) -> None:
        for sink in self._sinks:
            try:
                sink.on_snapshot(record)
            except Exception as err:  # noqa: BLE001 - nor the RPC
                self._failed(sink, "on_snapshot", err)

    def on_budget(self, budget: MemoryBudget) -> None:
        for sink in self._sinks:
            try:
                sink.on_budget(budget)
            except Exception as err:  # noqa: BLE001 - nor Warmup
                self._failed(sink, "on_budget", err)

    def on_pool_reset(self) -> None:
        for sink in self._sinks:
            try:
                sink.on_pool_reset()
            except Exception as err:  # noqa: BLE001 - nor the sizing
                self._failed(sink, "on_pool_reset", err)

    def close(self) -> None:
        for sink in reversed(self._sinks):
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001 - the rest must still shut down
                self._failed(sink, "close", err)

    def _failed(self, sink: TelemetrySink, report: str, err: Exception) -> None:
        n = self._failures[id(sink)] = self._failures.get(id(sink), 0) + 1
        name = type(sink).__name__
        if n == 1:
            logger.opt(exception=err).error(
                "telemetry: sink {} failed in {} ({}); the engine goes on without it for this report", name, report, err
            )
        elif n % FAILURE_LOG_EVERY == 0:
            logger.warning("telemetry: sink {} has failed {} times (last in {}: {})", name, n, report, err)
