"""Rewrite ``fuse`` (CPU): one q/k/v GEMM and one RoPE pass per Llama-form attention, one gate/up GEMM per
gated MLP, each kept only where it reproduces its module (:mod:`tgi_paged_backend.runner.cpu.fused_blocks`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tgi_paged_backend.runner.cpu.fused_blocks import FusionReport, fuse_blocks
from tgi_paged_backend.runner.parallel.row_parallel import local_sums
from tgi_paged_backend.runner.rewrites.base import Decision, RewriteContext, runs, skip


class FuseBlocks:
    name = "fuse"

    def applies(self, model: nn.Module, ctx: RewriteContext, done: Mapping[str, Any]) -> Decision:
        return runs() if ctx.device.type == "cpu" else skip(f"on {ctx.device.type} the unfused modules run")

    def apply(self, model: nn.Module, ctx: RewriteContext) -> tuple[FusionReport, int]:
        with local_sums(model):  # a tensor-parallel rank's checks: no collective (see local_sums)
            report = fuse_blocks(model, ctx.block_size, ctx.kv_dtype)
        return report, report.mlps + report.attentions
