"""Counters the engine keeps across steps (the telemetry exporter and the demo report read them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tgi_paged_backend.engine.model_step import StepOutput
from tgi_paged_backend.engine.scheduler import StepPlan


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_idle_steps: int = 0
    """Steps where every request waited (nothing fit)."""
    computed_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    preemptions: dict[str, int] = field(default_factory=lambda: {"swap": 0, "recompute": 0})
    swap_bytes: dict[str, int] = field(default_factory=lambda: {"out": 0, "in": 0})
    preempted_wait_s: list[float] = field(default_factory=list)
    prefix_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    """Prompt tokens whose blocks the disk tier supplied (read into the host tier at admission)."""
    prefix_query_tokens: int = 0
    draft_tokens: int = 0
    """Speculative tokens verified (``--speculate``)."""
    accepted_tokens: int = 0
    """Of those, the ones accepted."""
    peak_running_requests: int = 0
    """Most requests computing in one step (the admitted concurrency the pool sustained)."""

    def record_step(self, plan: StepPlan, out: StepOutput, *, swap_block_bytes: int) -> None:
        self.num_steps += 1
        if not plan.scheduled:
            self.num_idle_steps += 1
        self.computed_tokens += out.num_computed_tokens
        self.recomputed_tokens += out.num_recomputed_tokens
        self.generated_tokens += sum(len(g.tokens.ids) for g in out.generations)
        self.draft_tokens += out.num_draft_tokens
        self.accepted_tokens += out.num_accepted_tokens
        self.finished_requests += len(out.finished)
        for event in plan.preemptions:
            self.preemptions[event.mode] = self.preemptions.get(event.mode, 0) + 1
        for kind, src, _ in plan.copy_ops:
            if kind in self.swap_bytes:
                self.swap_bytes[kind] += len(src) * swap_block_bytes
        self.preempted_wait_s.extend(plan.resumed_wait_s)
        self.peak_running_requests = max(self.peak_running_requests, len(plan.scheduled))

    @property
    def recompute_tax(self) -> float:
        """Recomputed tokens divided by all computed tokens."""
        return self.recomputed_tokens / self.computed_tokens if self.computed_tokens else 0.0
