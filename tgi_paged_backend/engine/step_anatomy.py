"""Step anatomy: where one engine step's wall time goes, part by part (:data:`STEP_PARTS`).

The engine starts one :class:`StepTimer` per step and calls :meth:`StepTimer.lap` at each boundary;
the time since the previous boundary goes to the named part, so the parts add up to the step's wall
time with nothing counted twice. On CUDA the ``forward`` lap synchronises first (kernels run
asynchronously: without it their time would land in whichever part next waits on the device).
The result travels in ``StepRecord.part_s`` to ``tgi_paged_step_part_seconds{phase, part}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tgi_paged_backend.telemetry.step_record import STEP_PARTS

__all__ = ["STEP_PARTS", "StepTimer"]


class StepTimer:
    """Accumulates nanoseconds per part between consecutive :meth:`lap` calls."""

    __slots__ = ("ns", "_last", "_sync")

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.ns: dict[str, int] = dict.fromkeys(STEP_PARTS, 0)
        self._sync = sync
        self._last = time.perf_counter_ns()

    def lap(self, part: str) -> None:
        """Charge the time since the previous boundary to ``part``."""
        now = time.perf_counter_ns()
        self.ns[part] += now - self._last
        self._last = now

    def device_lap(self, part: str) -> None:
        """:meth:`lap` after waiting for queued device work (CUDA), so ``part`` owns its kernels."""
        if self._sync is not None:
            self._sync()
        self.lap(part)

    def add(self, part: str, ns: int) -> None:
        """Charge ``ns`` measured elsewhere (the previous step's telemetry) without moving the boundary."""
        self.ns[part] += ns

    def seconds(self) -> tuple[tuple[str, float], ...]:
        """``(part, seconds)`` for every part, in :data:`STEP_PARTS` order."""
        return tuple((part, ns / 1e9) for part, ns in self.ns.items())


def device_sync(device_type: str) -> Callable[[], None] | None:
    """``torch.cuda.synchronize`` on CUDA; ``None`` (nothing to wait for) on CPU."""
    if device_type != "cuda":
        return None
    import torch

    return torch.cuda.synchronize
