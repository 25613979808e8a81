"""Builds a :class:`StepRecord` from the engine's own per-step objects.

Duck-typed on purpose: telemetry imports no engine module (the engine imports telemetry). What it
reads:

- ``plan``: ``scheduled`` (list of ``(request, num_tokens)``), ``preemptions`` (objects with
  ``request_id``, ``mode``, ``num_tokens``, ``estimated_cost_s``), ``copy_ops`` (``(kind, src, dst)``
  with kind ``out``/``in``/``cow``), ``resumed_wait_s``, ``num_new_blocks``
  (``engine.scheduler.StepPlan``);
- ``out``: ``num_computed_tokens``, ``num_recomputed_tokens`` (``engine.model_step.StepOutput``);
- ``requests``: the engine's live requests, each with ``is_waiting``, ``is_preempted`` and
  ``preempted_at`` (a ``time.monotonic()`` stamp; ``engine.request_state.RequestState``), and for LoRA
  usage ``adapter`` and ``waiting_for_adapter``;
- ``adapters``: ``names`` and ``num_unknown`` (``lora.sources.AdapterNames``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tgi_paged_backend.memory.stats import MemoryStats
from tgi_paged_backend.telemetry.lora_usage import LoraUsage, lora_usage
from tgi_paged_backend.telemetry.step_record import Phase, PreemptionRecord, SnapshotRecord, StepRecord
from tgi_paged_backend.telemetry.tier_stats import TierStats


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """Live requests by (disjoint) state, as the ``tgi_paged_requests`` gauge reports them."""

    running: int
    waiting: int
    preempted: int
    max_preempted_wait_s: float
    """Longest current wait among the preempted ones (0 when none)."""


def count_requests(requests: Iterable[Any], now: float) -> RequestCounts:
    """Count ``requests`` as waiting (for memory, never preempted), preempted, or running."""
    running = preempted = waiting = 0
    max_wait = 0.0
    for request in requests:
        if request.is_waiting:
            waiting += 1
        elif request.is_preempted:
            preempted += 1
            if request.preempted_at is not None:
                max_wait = max(max_wait, now - request.preempted_at)
        else:
            running += 1
    return RequestCounts(running, waiting, preempted, max(max_wait, 0.0))


class StepRecordBuilder:
    """Turns ``(plan, out, memory stats)`` into a record; remembers the cumulative prefix counters.

    ``MemoryStats`` carries prefix-cache counters cumulative over the memory manager's life; records
    carry deltas. When the manager is rebuilt (Warmup re-sizes the pool) its counters restart at 0,
    and the next delta is the new cumulative value.

    With ``adapters`` (the engine's adapter names, see the module docstring) the records also count
    live requests per LoRA adapter, at most ``max_loras`` of them running in one step.
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, adapters: Any = None, max_loras: int | None = None
    ) -> None:
        self._clock = clock
        self._adapters = adapters
        self._max_loras = max_loras
        self._last_prefix_hit = 0
        self._last_grammar_hits = 0
        self._last_prefix_query = 0

    def build(
        self,
        *,
        plan: Any,
        out: Any,
        memory: MemoryStats,
        step_s: float,
        swap_block_bytes: int,
        requests: Iterable[Any],
        phase: Phase | None = None,
        grammar: Any = None,
        part_s: tuple[tuple[str, float], ...] = (),
        batch_id: int | None = None,
        batch_requests: int = 0,
        tiers: TierStats | None = None,
    ) -> StepRecord:
        """Record one step; ``phase=None`` infers it (prefill when any request computed > 1 token);
        ``grammar``: the engine's grammar compiler once it has one; ``part_s``: the step anatomy;
        ``batch_id``, ``batch_requests``: the router's batch the step ran for (``None``: the engine's own);
        ``tiers``: the KV tiers' snapshot (:func:`~.tier_stats.collect_tier_stats`)."""
        requests = tuple(requests)
        batch_size = len(plan.scheduled)
        if phase is None:
            phase = "prefill" if out.num_computed_tokens > batch_size else "decode"
        swap = {"out": 0, "in": 0}
        for kind, src, _dst in plan.copy_ops:
            if kind in swap:
                swap[kind] += len(src) * swap_block_bytes
        counts = count_requests(requests, self._clock())
        compile_s, hits = (
            ((), 0)
            if grammar is None
            else (grammar.take_compile_seconds(), self._delta_grammar_hits(grammar.cache_hits))
        )
        return StepRecord(
            phase=phase,
            step_s=max(step_s, 0.0),
            batch_size=batch_size,
            tokens_computed=out.num_computed_tokens,
            tokens_recomputed=out.num_recomputed_tokens,
            blocks_allocated=plan.num_new_blocks,
            preemptions=tuple(
                PreemptionRecord(
                    mode=e.mode,
                    victim_id=e.request_id,
                    tokens_lost=e.num_tokens,
                    estimated_cost_s=float(e.estimated_cost_s),
                )
                for e in plan.preemptions
            ),
            swap_out_bytes=swap["out"],
            swap_in_bytes=swap["in"],
            prefix_hit_tokens=self._delta_hit(memory.num_prefix_hit_tokens),
            prefix_query_tokens=self._delta_query(memory.num_prefix_query_tokens),
            image_tokens=getattr(out, "num_image_tokens", 0),
            images_encoded=getattr(out, "num_images_encoded", 0),
            resumed_wait_s=tuple(plan.resumed_wait_s),
            num_running=counts.running,
            num_preempted=counts.preempted,
            num_waiting=counts.waiting,
            max_preempted_wait_s=counts.max_preempted_wait_s,
            constrained_rows=getattr(out, "num_constrained_rows", 0),
            draft_tokens=getattr(out, "num_draft_tokens", 0),
            accepted_draft_tokens=getattr(out, "num_accepted_tokens", 0),
            grammar_compile_s=compile_s,
            grammar_cache_hits=hits,
            part_s=part_s,
            memory=memory,
            lora=self._lora(requests),
            tiers=tiers,
            batch_id=batch_id,
            batch_requests=batch_requests,
        )

    def snapshot(self, *, memory: MemoryStats, requests: Iterable[Any]) -> SnapshotRecord:
        """The pool and the live requests outside a step."""
        requests = tuple(requests)
        counts = count_requests(requests, self._clock())
        return SnapshotRecord(
            memory=memory,
            num_running=counts.running,
            num_preempted=counts.preempted,
            num_waiting=counts.waiting,
            lora=self._lora(requests),
        )

    def _lora(self, requests: Iterable[Any]) -> LoraUsage | None:
        adapters = self._adapters
        if adapters is None:
            return None
        return lora_usage(requests, adapters.names, self._max_loras, adapters.num_unknown)

    def _delta_grammar_hits(self, cumulative: int) -> int:
        delta, self._last_grammar_hits = cumulative - self._last_grammar_hits, cumulative
        return delta

    def _delta_hit(self, cumulative: int) -> int:
        delta = cumulative - self._last_prefix_hit if cumulative >= self._last_prefix_hit else cumulative
        self._last_prefix_hit = cumulative
        return delta

    def _delta_query(self, cumulative: int) -> int:
        delta = cumulative - self._last_prefix_query if cumulative >= self._last_prefix_query else cumulative
        self._last_prefix_query = cumulative
        return delta
