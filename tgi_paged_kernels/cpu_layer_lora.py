"""The LoRA adapters of one decoder layer, for the native decode step (:func:`.cpu_layer.decode_layer`).

A decode step whose rows use adapters adds each row's delta ``scale[s] * B[s] (A[s] x)`` to the outputs of
the projections the adapters target, inside the same native call (``csrc/cpu_lora.h``: the rows of one adapter
in groups of up to 8, each vector of its A and B read once for the group, ``csrc/cpu_lora_tiles.h``). Each
target is one projection of the layer (:data:`PROJECTIONS`) or one column range of a fused one (q, k and v of
the fused q/k/v GEMM, gate and up of gate/up), with every adapter's A and B stacked by slot as
:func:`tgi_paged_backend.lora.layers.attach_adapters` stacks them. The C++ reads pointers only: a
:class:`LayerLora` holds the tensors, :meth:`LayerLora.args` adds the step's per-row slots.

Reference: :func:`.cpu_layer_ref.decode_layer_ref` with ``lora``; ``tests/kernels/test_cpu_layer_lora.py``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cpu_lora import MAX_RANK, STACK_DTYPES

PROJECTIONS = ("qkv", "o", "gate_up", "down")
"""The layer's projections a target adds to (``LoraTarget::projection`` in C++ is the index)."""


class _Target(ctypes.Structure):
    """``LoraTarget`` of ``csrc/cpu_lora.h``, field for field."""

    _fields_ = [
        ("projection", ctypes.c_int32),
        ("max_rank", ctypes.c_int32),
        *((name, ctypes.c_int64) for name in ("column", "width", "in_features", "num_slots")),
        *((name, ctypes.c_void_p) for name in ("a", "bt", "scales", "ranks")),
        ("dtype", ctypes.c_int32),
    ]


class _LayerLora(ctypes.Structure):
    """``LayerLora`` of ``csrc/cpu_lora.h``."""

    _fields_ = [("num_targets", ctypes.c_int64), ("targets", ctypes.c_void_p), ("token_slots", ctypes.c_void_p)]


@dataclass(frozen=True, slots=True)
class LoraTarget:
    """Every adapter's A and B of one projection (or of its columns ``column .. column + N`` of a fused GEMM)."""

    projection: str
    """One of :data:`PROJECTIONS`."""
    column: int
    a_stack: torch.Tensor
    """fp32 or bf16 ``[S, R, K]`` contiguous; a slot of rank ``r < R`` has zero rows past ``r``."""
    b_stack: torch.Tensor
    """``[S, N, R]`` in A's dtype, a transposed view of a contiguous ``[S, R, N]`` (:func:`.cpu_lora.cpu_b_stack`).
    bf16 stacks (an fp32 model's adapters saved in bf16) are widened exactly in the tiles: the bits of fp32
    stacks of the same values, at half the bytes."""
    scales: torch.Tensor
    """fp32 ``[S]``."""
    ranks: torch.Tensor
    """int32 ``[S]``, each slot's own rank (0: the adapter leaves this projection out)."""

    def __post_init__(self) -> None:
        a, b = self.a_stack, self.b_stack
        fits = (
            self.projection in PROJECTIONS and self.column >= 0 and a.dim() == 3 and b.dim() == 3
            and a.dtype == b.dtype and a.dtype in STACK_DTYPES and self.scales.dtype == torch.float32
            and self.ranks.dtype == torch.int32
            and a.device.type == "cpu" and a.is_contiguous() and b.transpose(1, 2).is_contiguous()
            and (b.shape[0], b.shape[2]) == tuple(a.shape[:2]) and a.shape[1] <= MAX_RANK
            and self.scales.shape == self.ranks.shape == (a.shape[0],)
            and self.scales.is_contiguous() and self.ranks.is_contiguous()
        )  # fmt: skip
        if not fits:
            raise ValueError(
                f"LoraTarget {self.projection!r}: A {a.dtype} {tuple(a.shape)}, B {b.dtype} {tuple(b.shape)} are not "
                f"fp32 or bf16 CPU stacks of one dtype [S, R <= {MAX_RANK}, K] / [S, N, R] (B laid out [S, R, N]) with "
                "fp32 scales, int32 ranks [S]"
            )


class LayerLora:
    """The LoRA targets of one decoder layer (holds their tensors for the native call)."""

    def __init__(self, targets: Sequence[LoraTarget]) -> None:
        if not targets or len({int(t.a_stack.shape[0]) for t in targets}) != 1:
            raise ValueError("LayerLora: one or more targets, all with the same adapter slots")
        self.targets = tuple(targets)
        self.num_slots = int(targets[0].a_stack.shape[0])
        self._array = (_Target * len(targets))(
            *(
                _Target(
                    PROJECTIONS.index(t.projection),
                    int(t.a_stack.shape[1]),
                    t.column,
                    int(t.b_stack.shape[1]),
                    int(t.a_stack.shape[2]),
                    self.num_slots,
                    t.a_stack.data_ptr(),
                    t.b_stack.data_ptr(),
                    t.scales.data_ptr(),
                    t.ranks.data_ptr(),
                    STACK_DTYPES.index(t.a_stack.dtype),
                )
                for t in targets
            )
        )

    def args(self, token_slots: torch.Tensor) -> _LayerLora | None:
        """The C++ struct for one step whose row ``t`` uses slot ``token_slots[t]`` (``-1``: none); ``None`` unless
        the slots are an int64 contiguous CPU vector. The caller holds ``token_slots`` until the call returns."""
        if token_slots.dtype != torch.int64 or token_slots.dim() != 1 or not token_slots.is_contiguous():
            return None
        if token_slots.device.type != "cpu":
            return None
        return _LayerLora(len(self.targets), ctypes.addressof(self._array), token_slots.data_ptr())
