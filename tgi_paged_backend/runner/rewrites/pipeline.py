"""One ordered pipeline of load-time model rewrites.

A rewrite changes the loaded transformers model in place (slices it, wraps or replaces modules) and says
what it did. Each is an object with a ``name``, ``applies(model, ctx, done)`` (a :class:`~.base.Decision`:
whether it should run here, and why not) and ``apply(model, ctx)`` (its report and how many modules it
changed); :mod:`.base` defines the shape.
The order matters and is the order of :data:`MODEL_REWRITES`:

1. ``tp_slice``: cut each decoder layer to this rank (before anything wraps a linear);
2. ``lora``: wrap the linears the adapters target (the fusion stacks the wrapped layers' bases and keeps
   each projection's adapters on its own columns);
3. ``fuse``: one q/k/v and one gate/up GEMM per layer on CPU;
4. ``native``: the fused layers' decode step as one C++ call, any described layer form (needs ``fuse``);
5. ``pack``: the remaining plain linears packed for oneDNN, Llama-form RMSNorms fused.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from loguru import logger
from torch import nn

from tgi_paged_backend.runner.rewrites.base import AppliedRewrites, ModelRewrite, RewriteContext, RewriteOutcome
from tgi_paged_backend.runner.rewrites.fuse import FuseBlocks
from tgi_paged_backend.runner.rewrites.lora_wrap import LoraWrap
from tgi_paged_backend.runner.rewrites.native import NativeLayers
from tgi_paged_backend.runner.rewrites.pack import PackLinears
from tgi_paged_backend.runner.rewrites.tp_slice import TensorParallelSlice


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
    every: tuple[ModelRewrite, ...] = (TensorParallelSlice(), LoraWrap(), FuseBlocks(), NativeLayers(), PackLinears())
    unknown = set(without) - {rewrite.name for rewrite in every}
    if unknown:
        raise ValueError(f"unknown model rewrites {sorted(unknown)}")
    return tuple(rewrite for rewrite in every if rewrite.name not in without)
