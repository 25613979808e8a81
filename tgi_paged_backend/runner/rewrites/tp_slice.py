"""Rewrite ``tp_slice``: cut every decoder layer to this rank's heads and MLP columns, then move the shard to
the device (the tensor-parallel runner loads the full checkpoint on the CPU)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tgi_paged_backend.runner.parallel.slicing import ShardLayout, shard_model
from tgi_paged_backend.runner.rewrites.base import Decision, RewriteContext, runs, skip


class TensorParallelSlice:
    name = "tp_slice"

    def applies(self, model: nn.Module, ctx: RewriteContext, done: Mapping[str, Any]) -> Decision:
        if ctx.tp_group is None:
            return skip("one shard")
        return runs()

    def apply(self, model: nn.Module, ctx: RewriteContext) -> tuple[ShardLayout, int]:
        group = ctx.tp_group
        assert group is not None
        layout = shard_model(model, ctx.spec, group.rank, group.world_size, group.all_reduce_)
        model.to(ctx.device)
        return layout, layout.num_layers
