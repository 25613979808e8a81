"""Rewrite ``pack``: plain linears packed for oneDNN on CPU (a wide fp32 LM head, and every bf16 linear where oneDNN
has no bf16, for the native GEMM unless the native layers are off or the decode step is compiled), Llama-form RMSNorms
fused into one call
(:mod:`tgi_paged_backend.runner.cpu.fast_layers`; on CUDA only the norms change)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tgi_paged_backend.runner.cpu.fast_layers import SwapReport, swap_fast_layers
from tgi_paged_backend.runner.rewrites.base import Decision, RewriteContext, runs


class PackLinears:
    name = "pack"

    def applies(self, model: nn.Module, ctx: RewriteContext, done: Mapping[str, Any]) -> Decision:
        return runs()

    def apply(self, model: nn.Module, ctx: RewriteContext) -> tuple[SwapReport, int]:
        config = ctx.model_config
        report = swap_fast_layers(
            model, ctx.device, ctx.dtype, native_heads=config.native_layers and not config.compile_decode
        )
        return report, report.packed_linears + report.native_heads + report.native_bf16 + report.fused_norms
