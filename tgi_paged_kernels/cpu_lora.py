"""The CPU serving path of batched multi-LoRA: one native call per adapted layer and step (``csrc/cpu_lora.cpp``).

Same contract as :func:`tgi_paged_kernels.lora.add_lora_triton` (layouts in :mod:`tgi_paged_kernels.lora`),
for fp32 or bf16 CPU activations (a bf16 model's, added in fp32 and rounded once), plus ``ranks`` (int32 ``[S]``,
each slot's own rank, so padded ranks cost nothing).
``b_stack`` ``[S, N, R]`` must be a transposed view of a contiguous ``[S, R, N]`` tensor (what
:func:`cpu_b_stack` allocates): the expand then runs along ``N``, vectorized.
Each row's delta is two dot-product loops in the row's order (no batching across rows), so a row gives
the same bits whatever else is in the batch.
"""

from __future__ import annotations

import torch

from .cpu_native import NativeKernels
from .lora import check_lora

MAX_RANK = 256
"""Largest padded rank the native kernel takes (its per-row scratch); larger stacks use the torch path."""
STACK_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes of A and B the native kernels read (the C++ ``dtype`` codes are the index): bf16 stacks are an fp32
model's adapters saved in bf16, widened exactly in the kernel."""


def cpu_b_stack(num_slots: int, out_features: int, max_rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros ``[S, N, R]`` laid out as ``[S, R, N]`` (the layout :func:`add_lora_cpu` reads)."""
    return torch.zeros(num_slots, max_rank, out_features, dtype=dtype).transpose(1, 2)


def _is_cpu_layout(b_stack: torch.Tensor) -> bool:
    return b_stack.transpose(1, 2).is_contiguous()


def add_lora_cpu(
    native: NativeKernels,
    out: torch.Tensor,
    x: torch.Tensor,
    token_slots: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    scales: torch.Tensor,
    ranks: torch.Tensor,
) -> bool:
    """Add each row's adapter delta to ``out`` ``[T, N]`` in place; ``False`` (nothing done) unless every
    tensor is fp32 on the CPU with unit inner strides (A and B may be bf16 together: widened exactly) (the caller
    then uses the torch path). A bf16 model's ``out`` and ``x`` (both bf16) are widened in the kernel, each delta
    added in fp32 and the sum rounded once, as the native decode layer adds them.

    Raises ``ValueError`` for a slot ``>= S`` or a rank above ``R`` (nothing is written then).
    """
    tensors = (out, x, a_stack, b_stack, scales)
    stack_dtype = a_stack.dtype if b_stack.dtype == a_stack.dtype else None
    if (
        any(t.device.type != "cpu" for t in tensors)
        or out.dtype != x.dtype
        or out.dtype not in STACK_DTYPES
        or scales.dtype != torch.float32
        or stack_dtype not in STACK_DTYPES
        or a_stack.shape[1] > MAX_RANK
    ):
        return False
    check_lora(x, token_slots, a_stack, b_stack, scales, out=out)
    if tuple(ranks.shape) != (a_stack.shape[0],):
        raise ValueError(f"ranks must be [{a_stack.shape[0]}], got {tuple(ranks.shape)}")
    if out.stride(-1) != 1 or x.stride(-1) != 1 or not (a_stack.is_contiguous() and _is_cpu_layout(b_stack)):
        return False
    # Every tensor whose address goes to C++ is held in a local until the call returns: a copy made inside
    # the argument list (``t.contiguous().data_ptr()``) is freed before the kernel reads it.
    slots = token_slots if token_slots.dtype == torch.int64 else token_slots.long()
    slots, ranks, scales = slots.contiguous(), ranks.to(torch.int32).contiguous(), scales.contiguous()
    num_slots, max_rank, in_features = a_stack.shape
    status = native.lora_add(
        out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), slots.data_ptr(),
        out.shape[0], in_features, out.shape[1], a_stack.data_ptr(), b_stack.data_ptr(),
        num_slots, max_rank, scales.data_ptr(), ranks.data_ptr(), torch.get_num_threads(),
        STACK_DTYPES.index(a_stack.dtype), STACK_DTYPES.index(out.dtype),
    )  # fmt: skip
    if status:
        raise ValueError(f"add_lora_cpu: a slot is >= {num_slots} or a rank exceeds {max_rank} (status {status})")
    return True
