"""Per-query-head tensors of an attention module, cut to one rank's heads for tensor parallelism.

Rank ``r`` of ``N`` serves the contiguous query heads ``r * Hq / N .. (r + 1) * Hq / N`` (:mod:`.slicing` cuts
every q/k/v layout that way), so a tensor holding one value per query head keeps exactly those entries: the
attention sinks of gpt-oss (a parameter) and the ALiBi slopes of Bloom, MPT and Falcon-RW (the ``alibi_slopes``
buffer of :mod:`tgi_paged_backend.runner.families.alibi` and :mod:`tgi_paged_backend.runner.families.falcon`). Rank
``r`` thus needs the slopes of *its* heads, not the first ``Hq / N`` slopes: ALiBi's slopes fall geometrically with
the head index, so a rank given another's would bias its heads wrongly.
"""

from __future__ import annotations

import torch
from torch import nn

from tgi_paged_backend.runner.model.loader import ModelLoadError


def rank_heads(num_q_heads: int, rank: int, world_size: int) -> slice:
    """The query heads rank ``rank`` of ``world_size`` serves."""
    local = num_q_heads // world_size
    return slice(rank * local, (rank + 1) * local)


def shard_head_tensors(attn: nn.Module, num_q_heads: int, rank: int, world_size: int, where: str) -> None:
    """Cut ``attn``'s per-query-head ``sinks`` and ``alibi_slopes`` (in place) to rank ``rank``'s heads."""
    heads = rank_heads(num_q_heads, rank, world_size)
    sinks = getattr(attn, "sinks", None)
    if isinstance(sinks, torch.Tensor) and sinks.numel() == num_q_heads:  # gpt-oss: one per query head
        attn.sinks = nn.Parameter(sinks.detach()[heads].clone(), requires_grad=False)
    slopes = getattr(attn, "alibi_slopes", None)
    if isinstance(slopes, torch.Tensor):
        if slopes.shape != (num_q_heads,):
            raise ModelLoadError(
                f"tensor parallelism: {where}.alibi_slopes has shape {tuple(slopes.shape)}, expected one slope per "
                f"query head ({num_q_heads},): use --num-shard 1"
            )
        attn.alibi_slopes = slopes[heads].clone()  # still the module's (non-persistent) buffer
