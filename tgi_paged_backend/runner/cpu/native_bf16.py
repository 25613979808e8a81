"""What the load-time check of a bf16 decoder layer needs (:func:`.native_layers.wrap_native_layers`): the layer
run in fp32 for a while, and the bf16 step's tolerance.

A bf16 layer is proven in two steps. First its description, on the layer in fp32 (:func:`fp32_params`: every
bf16 parameter and buffer widened in place, which is exact, and narrowed back after, which gives the same bits):
the native step on fp32-packed weights must give the module's output and K/V to 1e-4, as for an fp32 model.
Then the bf16 step (bf16-packed weights, bf16 hidden state, pools of the KV dtype) against the module's own
bf16 step, on the same bf16-valued inputs, both measured from the fp32 module's output on them
(:func:`bf16_step_close`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

BF16_EPS = 2.0**-8
"""bf16's rounding unit (half an ulp at the top of a binade, relative): :func:`bf16_step_close`'s slack."""


def projection_dtype(layer: nn.Module) -> torch.dtype | None:
    """The dtype of the layer's matrices (its first 2-D parameter's), ``None`` when it has none."""
    return next((p.dtype for p in layer.parameters() if p.dim() == 2), None)


@contextmanager
def fp32_params(module: nn.Module) -> Iterator[None]:
    """``module``'s bf16 parameters and buffers widened to fp32 in place while the block runs, narrowed back
    after (bf16 -> fp32 -> bf16 is exact); tensors of other dtypes untouched."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.dtype == torch.bfloat16]
    for t in tensors:
        t.data = t.data.float()
    try:
        yield
    finally:
        for t in tensors:
            t.data = t.data.to(torch.bfloat16)


def bf16_step_close(native: torch.Tensor, per_op: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether the native bf16 step's result is as close to the fp32 module's (``exact``, on the same bf16-valued
    inputs and weights) as the module's own bf16 step is, within a factor two and one rounding:
    ``max|native - exact| <= 2 max|per_op - exact| + 2^-8 max|exact|``.

    The native step sums in fp32 and rounds once (its GEMM may round activations to bf16 first); the module rounds
    after every op: a right description lands well inside, a wrong packing or layout off by O(1)."""
    if native.shape != per_op.shape or native.shape != exact.shape:
        return False
    exact = exact.float()
    scale = exact.abs().max().item() if exact.numel() else 0.0
    native_error = (native.float() - exact).abs().max().item() if exact.numel() else 0.0
    per_op_error = (per_op.float() - exact).abs().max().item() if exact.numel() else 0.0
    return bool(native_error <= 2.0 * per_op_error + BF16_EPS * scale)
