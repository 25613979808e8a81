"""The greedy choice over a step's fp32 logits in one native call (``csrc/cpu_greedy.cpp``): each row's first
maximum and its log-probability, without torch's full ``[rows, vocab]`` ``log_softmax`` and a separate argmax.

:func:`greedy_pick_ref` is the specification in torch; ``tests/kernels/test_cpu_greedy.py`` compares the two.
"""

from __future__ import annotations

import torch

from .cpu_native import native_kernels


def greedy_pick_ref(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, logprobs)``: int64 ``argmax`` of each row (the first maximum; the first NaN when a row holds one)
    and fp32 ``log_softmax`` at it (NaN where torch's is: a NaN in the row, or an infinite maximum)."""
    ids = scores.argmax(dim=-1)
    return ids, torch.log_softmax(scores.float(), dim=-1).gather(1, ids[:, None]).squeeze(1)


def greedy_pick(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`greedy_pick_ref` for fp32 CPU logits ``[rows, vocab]`` with contiguous rows, natively (the sum of
    the softmax denominator in another order: a few ulp of the log-probability); ``None`` for other inputs or
    when the native kernels are off (the caller runs torch's)."""
    if scores.dtype != torch.float32 or not scores.is_cpu or scores.dim() != 2 or scores.stride(-1) != 1:
        return None
    rows, vocab = scores.shape
    native = native_kernels()
    if native is None or vocab < 1 or rows < 1:
        return None
    ids = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    status = native.greedy_pick(
        scores.data_ptr(), rows, vocab, scores.stride(0), ids.data_ptr(), logprobs.data_ptr(), torch.get_num_threads()
    )
    if status != 0:
        raise ValueError(f"greedy_pick: the native kernel returned status {status}")
    return ids, logprobs
