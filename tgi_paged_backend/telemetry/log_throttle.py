"""Preemption summaries on the log, without log storms.

Under memory pressure a shard can preempt on every step. Logging each event would flood the
launcher's log; logging none hides the pressure. :class:`PreemptionLogThrottle` accumulates events
and writes one summary line with counts by mode:

- the first event after a quiet period (``interval_s`` since the last summary) is logged at once;
- after that, pending events are summarised when ``every_events`` of them have piled up or
  ``interval_s`` has passed, whichever comes first, but never more often than once per
  ``min_interval_s`` -- so a storm costs at most one line per ``min_interval_s``.

Call :meth:`observe` once per step (with or without events: an empty call lets a pending summary
out when its time is up) and :meth:`flush` at shutdown.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable

from loguru import logger

from tgi_paged_backend.telemetry.step_record import PreemptionRecord


def _default_log(message: str) -> None:
    logger.warning(message)


class PreemptionLogThrottle:
    """Counts preemptions and emits rate-limited summaries (clock and sink injectable for tests)."""

    def __init__(
        self,
        *,
        every_events: int = 100,
        interval_s: float = 30.0,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = _default_log,
    ) -> None:
        if every_events < 1:
            raise ValueError(f"every_events={every_events} is invalid: allowed >= 1")
        if not 0.0 <= min_interval_s <= interval_s:
            raise ValueError(f"need 0 <= min_interval_s ({min_interval_s}) <= interval_s ({interval_s})")
        self.every_events = every_events
        self.interval_s = interval_s
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._log = log
        self._last_emit = -math.inf
        self._window_start: float | None = None
        self._pending: Counter[str] = Counter()
        self._pending_tokens = 0
        self._totals: Counter[str] = Counter()
        self.num_summaries = 0

    @property
    def num_pending(self) -> int:
        return sum(self._pending.values())

    def observe(self, events: Iterable[PreemptionRecord] = ()) -> str | None:
        """Count ``events``; return (and log) a summary line if one is due, else ``None``."""
        now = self._clock()
        for event in events:
            if self._window_start is None:
                self._window_start = now
            self._pending[event.mode] += 1
            self._totals[event.mode] += 1
            self._pending_tokens += event.tokens_lost
        pending = self.num_pending
        if not pending:
            return None
        since = now - self._last_emit
        due = since >= self.interval_s or (pending >= self.every_events and since >= self.min_interval_s)
        return self._emit(now) if due else None

    def flush(self) -> str | None:
        """Summarise whatever is pending now (shutdown)."""
        return self._emit(self._clock()) if self.num_pending else None

    def _emit(self, now: float) -> str:
        window = now - (self._window_start if self._window_start is not None else now)
        message = (
            f"KV pool pressure: {self.num_pending} preemption(s) in the last {window:.1f}s "
            f"({_by_mode(self._pending)}), {self._pending_tokens} tokens moved off the device; "
            f"{sum(self._totals.values())} since start ({_by_mode(self._totals)})"
        )
        self._pending.clear()
        self._pending_tokens = 0
        self._window_start = None
        self._last_emit = now
        self.num_summaries += 1
        self._log(message)
        return message


def _by_mode(counts: Counter[str]) -> str:
    return ", ".join(f"{mode}={n}" for mode, n in sorted(counts.items()))
