"""Rewrite ``native`` (CPU, fp32 and bf16 models): a fused decoder layer's decode step as one C++ call, for every
layer form :mod:`tgi_paged_backend.runner.cpu.layer_forms` describes (:mod:`tgi_paged_backend.runner.native.
layers`); on a tensor-parallel rank (fp32), native calls between the all-reduces, on the layers whose check
passed on every rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tgi_paged_backend.runner.native.layers import Agree, NativeLayersReport, wrap_native_layers
from tgi_paged_backend.runner.rewrites.base import Decision, RewriteContext, runs, skip

_DTYPES = (torch.float32, torch.bfloat16)
"""Model and KV dtypes the native layer runs (fp32 arithmetic, fp32 or bf16 weights, hidden state and pools)."""


class NativeLayers:
    name = "native"

    def applies(self, model: nn.Module, ctx: RewriteContext, done: Mapping[str, Any]) -> Decision:
        if "fuse" not in done:
            return skip("needs the fused blocks (CPU only)")
        if not ctx.model_config.native_layers:
            return skip("TGI_PAGED_NATIVE_LAYERS=0")
        if ctx.dtype not in _DTYPES:
            return skip(f"model in {ctx.dtype}: the native layer runs fp32 and bf16 models (fp16 runs per op)")
        if ctx.kv_dtype not in _DTYPES or (ctx.dtype == torch.float32 and ctx.kv_dtype != torch.float32):
            return skip(f"KV cache in {ctx.kv_dtype}: the native layer stores fp32 pools, or bf16 for a bf16 model")
        if ctx.model_config.compile_decode:
            # Its static step traces the per-op path, which would unpack the native layers' weights inside
            # the graph.
            return skip("TGI_PAGED_COMPILE traces the per-op path")
        return runs()

    def apply(self, model: nn.Module, ctx: RewriteContext) -> tuple[NativeLayersReport, int]:
        report = wrap_native_layers(model, ctx.block_size, ctx.kv_dtype, _agreement(ctx))
        return report, report.wrapped


def _agreement(ctx: RewriteContext) -> Agree | None:
    """A tensor-parallel rank's :data:`~..native.layers.Agree`: a layer passes where it passed on every rank
    (one all-gather of the outcomes on the control group); ``None`` on one shard."""
    group = ctx.tp_group
    if group is None:
        return None

    def agree(outcomes: list[bool]) -> list[bool]:
        ranks = group.all_gather_ints([int(ok) for ok in outcomes], "agreeing on the native decode layers")
        return [all(column) for column in zip(*ranks)]

    return agree
