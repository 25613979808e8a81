"""Kernels the engine's sampling runs on the logits a forward returned (the engine reaches kernels only
through the runner)."""

from __future__ import annotations

import torch

import tgi_paged_kernels


def greedy_in_one_pass(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Argmax and its log-probability per row in one native pass, or ``None`` (then sample the general way)."""
    return tgi_paged_kernels.greedy_in_one_pass(scores)
