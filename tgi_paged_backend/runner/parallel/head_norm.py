"""A q/k RMSNorm over all heads of a token (OLMo2's ``q_norm``/``k_norm``) on a rank that holds a shard of the heads.

OLMo2 normalizes each token's query (key) projection as one vector of ``Hq * head_dim`` (``Hkv * head_dim``)
values, not head by head. Its statistic is the mean of squares over all heads, which is a sum: every rank
computes the sum of squares of its own heads (a ``[tokens, 1]`` tensor), one all-reduce over the group adds
them, and each rank scales its own values with its slice of the norm weight. No activation is gathered.

When there are fewer KV heads than ranks, each KV head is held by ``N / Hkv`` ranks, so the all-reduced sum
counts every head ``N / Hkv`` times; dividing by ``local width * N`` (not the model's width) gives the mean of
every form alike: ``N / Hkv * S / (d * N) = S / (Hkv * d)``.

The class name does not end in ``RMSNorm`` on purpose: the load-time swaps that replace a model's RMSNorms
(``runner/cpu/fast_layers.py``) or read one into the native decode layer (``runner/cpu/layer_forms.py``) find
norms by that name, and neither can express the all-reduce, so both leave this module alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tgi_paged_backend.runner.cpu.fast_layers import rms_norm_eps
from tgi_paged_backend.runner.model.loader import ModelLoadError

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the ranks in place and returns it."""


class AllHeadsNormShard(nn.Module):
    """``w_local * x_local / sqrt(all_reduce(sum(x_local^2)) / (width_local * N) + eps)``, computed in fp32.

    ``weight_in_fp32``: the weight multiplies the fp32 normalized values before the cast back to the input
    dtype (OLMo2's order); otherwise the values are cast first (Llama's). :func:`shard_all_heads_norm` picks the
    order the unsharded module uses."""

    def __init__(
        self,
        weight: torch.Tensor,
        eps: float,
        world_size: int,
        all_reduce: AllReduce,
        *,
        weight_in_fp32: bool = True,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps = float(eps)
        self.reduced_width = int(weight.numel()) * world_size
        """What the all-reduced sum of squares is divided by (see the module docstring)."""
        self.weight_in_fp32 = weight_in_fp32
        self._all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        sum_sq = self._all_reduce(x.pow(2).sum(-1, keepdim=True))
        normed = x * torch.rsqrt(sum_sq / self.reduced_width + self.eps)
        if self.weight_in_fp32:
            return (self.weight * normed).to(dtype)
        return self.weight * normed.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)} of {self.reduced_width} (all-reduced), eps={self.eps}"


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    xf = x.to(torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed).to(x.dtype) if weight_in_fp32 else weight * normed.to(x.dtype)


def shard_all_heads_norm(
    norm: nn.Module, rows: slice, world_size: int, all_reduce: AllReduce, where: str
) -> AllHeadsNormShard:
    """This rank's shard of ``norm`` (an RMSNorm over a whole q or k projection) for the projection's output
    ``rows`` it holds. ``norm`` must compute ``w * x / sqrt(mean(x^2) + eps)`` (checked on a random input,
    against both cast orders); any other all-heads norm raises :class:`ModelLoadError`."""
    eps = rms_norm_eps(norm)
    weight = getattr(norm, "weight", None)
    refusal = ModelLoadError(
        f"tensor parallelism: {where} normalizes across all heads with a {type(norm).__name__} that is not "
        "an RMSNorm (w * x / sqrt(mean(x^2) + eps)), which this slicing cannot split: use --num-shard 1"
    )
    if eps is None or not isinstance(weight, torch.Tensor):
        raise refusal
    x = torch.randn(3, weight.numel(), generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.inference_mode():
        got = norm(x)
    for weight_in_fp32 in (True, False):
        if torch.equal(got, _reference(x, weight.detach(), eps, weight_in_fp32)):
            return AllHeadsNormShard(
                weight.detach()[rows], eps, world_size, all_reduce, weight_in_fp32=weight_in_fp32
            ).to(weight.device)
    raise refusal
