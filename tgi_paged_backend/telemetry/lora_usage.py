"""Which LoRA adapters run and wait, as the ``tgi_paged_lora_*`` metrics report them.

The Kubernetes inference gateway's endpoint picker reads LoRA affinity from one info gauge whose labels
are ``max_lora``, ``running_lora_adapters`` and ``waiting_lora_adapters`` (comma-separated names) and
whose value is the time of the last update (vLLM's ``vllm:lora_requests_info``); per-adapter request
counts are for dashboards. Duck-typed on the engine's requests (``adapter``, ``waiting_for_adapter``,
``is_waiting``, ``is_preempted``), as :mod:`.engine_adapter`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LoraUsage:
    """Live requests per adapter at one moment. ``""`` names the base model in the counts."""

    max_loras: int
    """Adapters that may run in one step (``TGI_PAGED_MAX_LORAS``, else the number loaded; 0 without)."""
    running: dict[str, int]
    """Requests running (computing or holding KV), by adapter name."""
    waiting: dict[str, int]
    """Requests waiting (for an adapter slot, for memory, or preempted), by adapter name."""
    num_unknown: int
    """Requests so far whose ``adapter_id`` named no loaded adapter (served by the base model)."""
    updated_at: float
    """Unix time of this snapshot."""

    @property
    def running_adapters(self) -> list[str]:
        return sorted(name for name, n in self.running.items() if n and name)

    @property
    def waiting_adapters(self) -> list[str]:
        return sorted(name for name, n in self.waiting.items() if n and name)


def lora_usage(
    requests: Iterable[Any],
    names: Sequence[str],
    max_loras: int | None,
    num_unknown: int,
    clock: Callable[[], float] = time.time,
) -> LoraUsage:
    """Count ``requests`` per adapter (``names[i]`` is adapter index ``i + 1``; 0 is the base model ``""``)."""
    labels = ["", *names]
    running = dict.fromkeys(labels, 0)
    waiting = dict.fromkeys(labels, 0)
    for request in requests:
        name = labels[request.adapter]
        if request.waiting_for_adapter or request.is_waiting or request.is_preempted:
            waiting[name] += 1
        else:
            running[name] += 1
    bound = len(names) if max_loras is None else min(max_loras, len(names))
    return LoraUsage(bound, running, waiting, num_unknown, clock())
