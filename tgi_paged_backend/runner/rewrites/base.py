"""What a load-time model rewrite is: its context, its decision to run, its outcome (the pipeline that runs
them in order: :mod:`.pipeline`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
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
