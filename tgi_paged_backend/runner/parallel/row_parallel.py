"""Row-parallel linears for tensor parallelism: each rank holds the input columns of its share of the features
(the heads or MLP columns :mod:`.slicing` gave it), computes its partial product, and one all-reduce sums the
ranks' parts before the (replicated) bias is added once. Quantized linears (``Fp8Linear``/``IntLinear``) keep
the unsharded layer's scales and zero points for their columns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tgi_paged_backend.runner.model.loader import ModelLoadError
from tgi_paged_backend.runner.quant.linear import QUANTIZED_LINEARS, QuantizedLinear

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the ranks in place and returns it."""


def _unreduced(t: torch.Tensor) -> torch.Tensor:
    return t


@contextmanager
def local_sums(module: nn.Module) -> Iterator[None]:
    """Within: every all-reduce held by ``module`` or a module under it (row-parallel linears, sharded norms and
    blocks: their ``_all_reduce``) is the identity, so the rank computes its own partial sums.

    For the load-time checks that compare a replacement with the module it replaces on each rank alone: no
    collective runs, so a check whose outcome differs between ranks cannot leave them in different collectives
    (the ranks agree on the outcome afterwards, e.g. ``runner.native.layers.wrap_native_layers``). Both sides
    of such a check sum at the same points, so equal partial sums mean equal all-reduced ones."""
    held = [(m, m.__dict__["_all_reduce"]) for m in module.modules() if m.__dict__.get("_all_reduce") is not None]
    for m, _ in held:
        m.__dict__["_all_reduce"] = _unreduced
    try:
        yield
    finally:
        for m, all_reduce in held:
            m.__dict__["_all_reduce"] = all_reduce


class RowParallelQuantLinear(nn.Module):
    """:class:`RowParallelLinear` for an ``Fp8Linear``/``IntLinear`` quantized before sharding: this rank's
    ``input_slice`` of it (fp8: the full-row scales; int: its columns' groups), so every rank uses the
    unsharded model's scales and zero points."""

    def __init__(self, linear: QuantizedLinear, rank: int, world_size: int, all_reduce: AllReduce) -> None:
        super().__init__()
        if linear.in_features % world_size:
            raise ModelLoadError(f"row-parallel linear: in_features={linear.in_features} not divisible by {world_size}")
        width = linear.in_features // world_size
        self.shard_in_columns = slice(rank * width, (rank + 1) * width)
        """The unsharded layer's input features this rank holds (LoRA cuts its A to them)."""
        try:
            self.local = linear.input_slice(self.shard_in_columns)
        except ValueError as err:
            raise ModelLoadError(f"row-parallel linear: {err}") from None
        self.in_features, self.out_features = width, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self._all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._all_reduce(self.local(x))
        return out if self.bias is None else out + self.bias


RowParallelFp8Linear = RowParallelQuantLinear
"""The name this class had when only fp8 was served."""


def row_parallel(linear: nn.Linear | QuantizedLinear, rank: int, world_size: int, all_reduce: AllReduce) -> nn.Module:
    if isinstance(linear, QUANTIZED_LINEARS):
        return RowParallelQuantLinear(linear, rank, world_size, all_reduce)
    return RowParallelLinear(linear, rank, world_size, all_reduce)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: the input features are split over the ranks."""

    def __init__(self, linear: nn.Linear, rank: int, world_size: int, all_reduce: AllReduce) -> None:
        super().__init__()
        if linear.in_features % world_size:
            raise ModelLoadError(f"row-parallel linear: in_features={linear.in_features} not divisible by {world_size}")
        width = linear.in_features // world_size
        self.in_features = width
        self.shard_in_columns = slice(rank * width, (rank + 1) * width)
        """The unsharded layer's input features this rank holds (LoRA cuts its A to them)."""
        self.out_features = linear.out_features
        # A plain bias-free nn.Linear over this rank's columns: the fast-layer swap packs it like any linear.
        self.local = nn.Linear(
            width, linear.out_features, bias=False, device=linear.weight.device, dtype=linear.weight.dtype
        )
        self.local.weight = nn.Parameter(
            linear.weight.detach()[:, rank * width : (rank + 1) * width].clone(), requires_grad=False
        )
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self._all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._all_reduce(self.local(x))
        return out if self.bias is None else out + self.bias

    @property
    def all_reduce(self) -> AllReduce:
        """What sums this rank's partial products over the ranks (the native decode layer calls it itself)."""
        return self._all_reduce

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (local), out_features={self.out_features}, bias={self.bias is not None}"
