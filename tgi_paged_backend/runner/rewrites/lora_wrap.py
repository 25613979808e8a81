"""Rewrite ``lora``: wrap every linear an adapter of ``LORA_ADAPTERS`` targets (this rank's part of it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tgi_paged_backend.lora.layers import LoraModel, attach_adapters
from tgi_paged_backend.runner.rewrites.base import Decision, RewriteContext, runs, skip


class LoraWrap:
    name = "lora"

    def applies(self, model: nn.Module, ctx: RewriteContext, done: Mapping[str, Any]) -> Decision:
        return runs() if ctx.adapters else skip("no LORA_ADAPTERS")

    def apply(self, model: nn.Module, ctx: RewriteContext) -> tuple[LoraModel, int]:
        lora = attach_adapters(model, ctx.adapters, ctx.device)
        assert lora is not None  # adapters were given
        return lora, lora.num_wrapped
