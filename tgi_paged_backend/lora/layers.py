"""Batched LoRA deltas in the forward: every adapted linear layer becomes a :class:`LoraLinear`.

:func:`attach_adapters` runs once after loading (after tensor-parallel sharding, before the fast-layer
swaps): each linear that some adapter targets is wrapped, the wrapper holding every adapter's A and B for
that layer stacked by slot (slot ``i`` is adapter index ``i + 1``; ranks padded with zeros to the layer's
largest, adapters that leave the layer out are zeros). A step's rows are routed by
:class:`LoraStep`, which the runner opens around the forward: ``token_slots`` (``-1``: the base model)
and, on CPU, the rows of each adapter present. ``y = base(x)``, then for each adapter's rows
``y[rows] += scaling * (x[rows] @ A.T) @ B.T`` (PEFT's order of operations): on CPU one gather and two
small GEMMs per adapter present in the step, on CUDA two Triton kernels over all rows
(:func:`tgi_paged_kernels.lora.add_lora_triton`). A step without adapter rows costs one attribute read
per wrapped layer.

Tensor parallelism: a column-parallel layer (``shard_out_rows`` set by :mod:`..runner.tp_slicing`)
keeps its rows of B; a row-parallel one (``shard_in_columns``) gets the wrapper on its local GEMM with its
columns of A, so each rank adds its part of the delta before the all-reduce that sums the parts (exact:
the delta is linear in the input columns), and no extra collective runs.

The load-time swaps see through the wrappers: the fusion of q/k/v and gate/up stacks the wrapped GEMMs and
wraps the fused one again, each projection's adapters adding into its own output columns
(:func:`stack_with_lora`); the fast-layer swap packs the GEMM under the wrappers (the innermost ``base``);
a native decoder layer keeps its one-call decode for steps without adapter rows and runs the per-op path,
wrappers included, for the others (:func:`find_lora_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from loguru import logger
from torch import nn

from tgi_paged_backend.lora.checkpoint import LoraAdapter
from tgi_paged_kernels import add_lora_cpu, add_lora_triton, cpu_b_stack, native_kernels


@dataclass(slots=True)
class LoraStep:
    """The current step's routing, shared by every :class:`LoraLinear` of one model (one per runner).

    ``token_slots is None`` outside a step and in steps with no adapter rows."""

    token_slots: torch.Tensor | None = None
    """``[T]`` int64 slot per packed row, ``-1`` for the base model."""
    groups: list[tuple[int, torch.Tensor | slice]] = field(default_factory=list)
    """CPU: ``(slot, rows)`` per adapter present, rows as a slice when contiguous."""

    @contextmanager
    def open(self, token_slots: torch.Tensor | None) -> Iterator[None]:
        """Route the rows of one forward (``None`` or all ``-1``: base model only)."""
        self.token_slots, self.groups = None, []
        if token_slots is not None:
            slots_np = token_slots.cpu().numpy() if token_slots.device.type == "cpu" else None
            if slots_np is None or (slots_np >= 0).any():
                self.token_slots = token_slots
                if slots_np is not None:
                    self.groups = _groups(slots_np)
        try:
            yield
        finally:
            self.token_slots, self.groups = None, []


def _groups(slots: np.ndarray) -> list[tuple[int, torch.Tensor | slice]]:
    groups: list[tuple[int, torch.Tensor | slice]] = []
    for slot in np.unique(slots):
        if slot < 0:
            continue
        rows = np.flatnonzero(slots == slot)
        if rows[-1] - rows[0] + 1 == len(rows):
            groups.append((int(slot), slice(int(rows[0]), int(rows[-1]) + 1)))
        else:
            groups.append((int(slot), torch.from_numpy(rows.astype(np.int64))))
    return groups


class LoraLinear(nn.Module):
    """``base(x)`` plus the LoRA delta of each row's adapter (see the module docstring)."""

    a_stack: torch.Tensor
    b_stack: torch.Tensor
    scales: torch.Tensor
    rank_tensor: torch.Tensor

    def __init__(
        self,
        base: nn.Module,
        a_stack: torch.Tensor,
        b_stack: torch.Tensor,
        scales: torch.Tensor,
        ranks: Sequence[int],
        step: LoraStep,
        columns: slice | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = int(a_stack.shape[2])
        self.out_features = int(cast(int, base.out_features))
        self.columns = columns
        """The base output columns the delta goes to (``None``: all): one projection of a fused GEMM."""
        self.register_buffer("a_stack", a_stack, persistent=False)
        """``[S, R, in]``: A of every slot, zero rows past its rank."""
        self.register_buffer("b_stack", b_stack, persistent=False)
        """``[S, out, R]``: B of every slot, zero columns past its rank."""
        self.register_buffer("scales", scales, persistent=False)
        """``[S]`` float32 scaling of every slot."""
        self.ranks = tuple(int(r) for r in ranks)
        """Rank of every slot at this layer (0: the adapter leaves it out)."""
        self.register_buffer("rank_tensor", torch.tensor(self.ranks, dtype=torch.int32), persistent=False)
        self.scale_values = tuple(float(s) for s in scales.tolist())
        self._step = step
        self._native = native_kernels() if a_stack.device.type == "cpu" else None

    def rewrap(self, base: nn.Module, columns: slice) -> LoraLinear:
        """The same adapters over ``base`` (a fused GEMM), adding into its output ``columns`` (shares the stacks)."""
        return LoraLinear(base, self.a_stack, self.b_stack, self.scales, self.ranks, self._step, columns)

    @property
    def step(self) -> LoraStep:
        return self._step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self._step.token_slots
        if slots is None:
            return y
        x2, y2 = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        if x2.shape[0] != slots.shape[0]:  # a layer that sees only some rows: never apply deltas to the wrong ones
            raise RuntimeError(f"LoRA layer got {x2.shape[0]} rows for a step of {slots.shape[0]} tokens")
        if self.columns is not None:
            y2 = y2[:, self.columns]
        if x.device.type == "cuda":
            add_lora_triton(y2, x2, slots, self.a_stack, self.b_stack, self.scales)
            return y
        if self._native is not None and add_lora_cpu(
            self._native, y2, x2, slots, self.a_stack, self.b_stack, self.scales, self.rank_tensor
        ):
            return y
        for slot, rows in self._step.groups:
            rank = self.ranks[slot]
            if rank == 0:
                continue
            a, b = self.a_stack[slot, :rank], self.b_stack[slot, :, :rank]
            if a.dtype != x2.dtype:  # bf16 stacks of an fp32 model: widened (exact)
                a, b = a.to(x2.dtype), b.to(x2.dtype)
            xa = x2[rows] @ a.T
            delta = (xa @ b.T) * self.scale_values[slot]
            if isinstance(rows, slice):
                y2[rows] += delta
            else:
                y2.index_add_(0, rows, delta)
        return y

    def extra_repr(self) -> str:
        where = "" if self.columns is None else f", columns={self.columns.start}:{self.columns.stop}"
        return f"adapters={sum(1 for r in self.ranks if r)}, max_rank={int(self.a_stack.shape[1])}{where}"


def lora_base(module: nn.Module) -> nn.Module:
    """The GEMM under any :class:`LoraLinear` wrappers of ``module`` (``module`` itself when it has none)."""
    while isinstance(module, LoraLinear):
        module = module.base
    return module


def replace_lora_base(module: nn.Module, base: nn.Module) -> nn.Module:
    """``module`` with the GEMM under its wrappers replaced by ``base`` (``base`` when ``module`` has none)."""
    if not isinstance(module, LoraLinear):
        return base
    inner = module
    while isinstance(inner.base, LoraLinear):
        inner = inner.base
    inner.base = base
    return module


def stack_with_lora(parts: Sequence[nn.Module], stack: Callable[[list[nn.Module]], nn.Module]) -> nn.Module:
    """``stack`` (one GEMM of the parts' bases side by side), wrapped again by each part's adapters over the
    columns of its own outputs, so a fused q/k/v or gate/up GEMM keeps every projection's LoRA."""
    fused = stack([lora_base(p) for p in parts])
    offset = 0
    for part in parts:
        width = int(cast(int, lora_base(part).out_features))
        if isinstance(part, LoraLinear):
            fused = part.rewrap(fused, slice(offset, offset + width))
        offset += width
    return fused


def find_lora_step(module: nn.Module) -> LoraStep | None:
    """The routing of the adapters anywhere under ``module`` (``None``: no adapted layer there)."""
    for child in module.modules():
        if isinstance(child, LoraLinear):
            return child.step
    return None


@dataclass(frozen=True, slots=True)
class LoraModel:
    """What :func:`attach_adapters` did: the adapters, the routing they share, the wrapped layers."""

    adapters: tuple[LoraAdapter, ...]
    step: LoraStep
    num_wrapped: int
    num_bytes: int
    """Bytes of the stacked A/B (this rank's slices, padding included): resident, out of the KV budget."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.adapters)


def _shard(module: nn.Module, a: torch.Tensor, b: torch.Tensor) -> tuple[nn.Module, str, torch.Tensor, torch.Tensor]:
    """Where the wrapper goes (the module itself, or a row-parallel layer's local GEMM) and this rank's A, B."""
    columns = getattr(module, "shard_in_columns", None)
    if isinstance(columns, slice):
        return module, "local", a[:, columns], b
    rows = getattr(module, "shard_out_rows", None)
    if isinstance(rows, slice):
        return module, "", a, b[rows]
    return module, "", a, b


def attach_adapters(model: nn.Module, adapters: Sequence[LoraAdapter], device: torch.device) -> LoraModel | None:
    """Wrap every linear of ``model`` that an adapter targets (in place); ``None`` without adapters.

    ``adapters`` were checked against the unsharded model (:func:`.checkpoint.load_adapters`); here each
    is cut to this rank's part of a sharded layer.
    """
    if not adapters:
        return None
    step = LoraStep()
    modules = dict(model.named_modules())
    paths = sorted({path for adapter in adapters for path in adapter.modules})
    num_bytes = 0
    # the model's compute dtype, which load_adapters cast every A and B to, or bf16 when every adapter kept its bf16
    # (an fp32 model on CPU): some kept, some not, they stack in fp32 (bf16 values widen exactly)
    dtypes = {adapter.dtype for adapter in adapters}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    for path in paths:
        parent_path, _, attr = path.rpartition(".")
        parent, module = modules[parent_path], modules[path]
        per_slot = [adapter.modules.get(path) for adapter in adapters]
        present = [w for w in per_slot if w is not None]
        owner, local_attr, a0, b0 = _shard(module, present[0].a, present[0].b)
        target = getattr(owner, local_attr) if local_attr else module
        max_rank = max(w.rank for w in present)
        in_local, out_local = int(a0.shape[1]), int(b0.shape[0])
        a_stack = torch.zeros(len(adapters), max_rank, in_local, dtype=dtype)
        b_stack = (  # on CPU laid out as [S, R, out], which the native kernel reads along out
            cpu_b_stack(len(adapters), out_local, max_rank, dtype)
            if device.type == "cpu"
            else torch.zeros(len(adapters), out_local, max_rank, dtype=dtype)
        )
        scales = torch.zeros(len(adapters), dtype=torch.float32)
        ranks = []
        for slot, weights in enumerate(per_slot):
            if weights is None:
                ranks.append(0)
                continue
            _, _, a, b = _shard(module, weights.a, weights.b)
            a_stack[slot, : weights.rank] = a
            b_stack[slot, :, : weights.rank] = b
            scales[slot] = weights.scaling
            ranks.append(weights.rank)
        wrapper = LoraLinear(target, a_stack.to(device), b_stack.to(device), scales.to(device), ranks, step)
        num_bytes += (a_stack.numel() + b_stack.numel()) * a_stack.element_size()
        if local_attr:
            setattr(owner, local_attr, wrapper)
        else:
            setattr(parent, attr, wrapper)
    logger.info(
        "LoRA: {} adapters ({}) over {} layers, {:.1f} MiB",
        len(adapters),
        ", ".join(a.name for a in adapters),
        len(paths),
        num_bytes / 2**20,
    )
    return LoraModel(tuple(adapters), step, len(paths), num_bytes)
