"""One ordered pipeline of load-time model rewrites.

A rewrite changes the loaded transformers model in place (slices it, wraps or replaces modules) and says
what it did. Each is an object with a ``name``, ``applies(model, ctx, done)`` (a :class:`Decision`: whether
it should run here, and why not) and ``apply(model, ctx)`` (its report and how many modules it changed).
The order matters and is the order of :data:`MODEL_REWRITES`:

1. ``tp_slice``: cut each decoder layer to this rank (before anything wraps a linear);
2. ``lora``: wrap the linears the adapters target (the fusion then leaves those layers, no longer plain
   linears, alone);
3. ``fuse``: one q/k/v and one gate/up GEMM per layer on CPU;
4. ``native``: the fused Llama-form layers' decode step as one C++ call (needs ``fuse``);
5. ``pack``: the remaining plain linears packed for oneDNN, Llama-form RMSNorms fused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from loguru import logger
from torch import nn

from tgi_paged_backend.config import ModelConfig
from tgi_paged_backend.lora.checkpoint import LoraAdapter
from tgi_paged_backend.runner.model.spec import ModelSpec

if TYPE_CHECKING:
    from tgi_paged_backend.runner.parallel.process_group import TensorParallelGroup


@dataclass(frozen=True, slots=True, kw_only=True)
class RewriteContext:
    """What the rewrites may read about this runner (built once at load)."""

    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    """The model's compute dtype."""
    kv_dtype: torch.dtype
    block_size: int
    spec: ModelSpec
    """The unsharded model's sizes."""
    adapters: tuple[LoraAdapter, ...] = ()
    tp_group: TensorParallelGroup | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """Whether a rewrite runs; ``reason`` says why not (or a note when it does)."""

    applies: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.applies


def runs(note: str = "") -> Decision:
    return Decision(True, note)


def skip(reason: str) -> Decision:
    return Decision(False, reason)


class ModelRewrite(Protocol):
    name: str

    def applies(self, model: nn.Module, ctx: RewriteContext, done: Mapping[str, Any]) -> Decision:
        """Whether to run on ``model`` here; ``done`` maps the rewrites that ran before to their reports."""
        ...

    def apply(self, model: nn.Module, ctx: RewriteContext) -> tuple[Any, int]:
        """Rewrite ``model`` in place; return the report and how many modules (layers, linears) changed."""
        ...


@dataclass(frozen=True, slots=True)
class RewriteOutcome:
    name: str
    ran: bool
    changed: int = 0
    reason: str = ""

    def describe(self) -> str:
        if self.ran:
            return f"{self.name} ({self.changed} modules)"
        return f"{self.name} skipped: {self.reason}"


@dataclass(slots=True)
class AppliedRewrites:
    """The reports of the rewrites that ran (by name) and every rewrite's outcome, in order."""

    reports: dict[str, Any] = field(default_factory=dict)
    outcomes: list[RewriteOutcome] = field(default_factory=list)

    def get(self, name: str) -> Any:
        """The report of rewrite ``name``, ``None`` if it did not run."""
        return self.reports.get(name)

    def summary(self) -> str:
        return "; ".join(outcome.describe() for outcome in self.outcomes)


def run_rewrites(model: nn.Module, ctx: RewriteContext, rewrites: Sequence[ModelRewrite]) -> AppliedRewrites:
    """Apply ``rewrites`` in order to ``model`` (in place) and log one line of what ran and why not."""
    applied = AppliedRewrites()
    for rewrite in rewrites:
        decision = rewrite.applies(model, ctx, applied.reports)
        if not decision:
            applied.outcomes.append(RewriteOutcome(rewrite.name, False, reason=decision.reason))
            continue
        report, changed = rewrite.apply(model, ctx)
        applied.reports[rewrite.name] = report
        applied.outcomes.append(RewriteOutcome(rewrite.name, True, changed))
    logger.info("model rewrites: {}", applied.summary())
    return applied


def model_rewrites(*, without: Collection[str] = ()) -> tuple[ModelRewrite, ...]:
    """The rewrites every runner applies, in order (see the module docstring); ``without``: names left out
    (tests and benchmarks comparing against the plain model)."""
    from tgi_paged_backend.runner.rewrites.fuse import FuseBlocks
    from tgi_paged_backend.runner.rewrites.lora_wrap import LoraWrap
    from tgi_paged_backend.runner.rewrites.native import NativeLayers
    from tgi_paged_backend.runner.rewrites.pack import PackLinears
    from tgi_paged_backend.runner.rewrites.tp_slice import TensorParallelSlice

    every: tuple[ModelRewrite, ...] = (TensorParallelSlice(), LoraWrap(), FuseBlocks(), NativeLayers(), PackLinears())
    unknown = set(without) - {rewrite.name for rewrite in every}
    if unknown:
        raise ValueError(f"unknown model rewrites {sorted(unknown)}")
    return tuple(rewrite for rewrite in every if rewrite.name not in without)
