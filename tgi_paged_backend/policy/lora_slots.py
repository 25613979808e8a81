"""Which LoRA adapters run in a step: at most ``max_loras`` distinct adapters per step.

The scheduler walks a step's requests in priority order (oldest first) and asks :func:`may_run_adapter`
for each; an adapter runs once one of its requests was scheduled. So the adapters of the oldest
requests keep their places until those requests finish (no thrash between adapters from step to step),
and a request of another adapter waits in the batch, holding what it holds, as a request waiting for
blocks does. The base model (index 0) never counts.
"""

from __future__ import annotations

from collections.abc import Set

BASE = 0


def may_run_adapter(adapter: int, running: Set[int], max_loras: int | None) -> bool:
    """Whether a request of ``adapter`` may run in a step whose scheduled requests use ``running``.

    Args:
        adapter: The request's adapter index (0: the base model).
        running: Adapter indices (> 0) already scheduled in this step.
        max_loras: Distinct adapters allowed per step; ``None``: no bound.
    """
    if adapter == BASE or max_loras is None or adapter in running:
        return True
    return len(running) < max_loras
