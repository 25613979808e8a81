"""How many bytes the KV pool may take: host RAM, the CPU activation estimate, the budget formula and the
device <-> host copy bandwidth. Pure functions of a :class:`~.model.spec.ModelSpec` and the device, shared by
:class:`~.model_runner.ModelRunner` (Warmup) and ``tgi-paged-backend plan`` (which must not drift from it).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from tgi_paged_backend.runner.model.spec import ModelSpec

CPU_KV_BUDGET_CAP_BYTES = 4 * 1024**3
"""On CPU the pool gets ``memory_fraction`` of the available RAM minus the activation estimate,
capped at this many bytes, so a CPU server (tests, demos) keeps a sane pool size."""


def cpu_available_bytes() -> int:
    """Available host RAM now (psutil when installed, else Linux sysconf)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # psutil is optional; Linux sysconf is enough
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_total_bytes(device: torch.device) -> int:
    """Total memory of the device (host RAM on CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def estimate_prefill_bytes(spec: ModelSpec, dtype: Any, num_tokens: int, num_logits: int) -> int:
    """The CPU activation estimate of a prefill of ``num_tokens``: hidden states, QKV, MLP, a naive
    attention-score matrix for the longest request and ``num_logits`` logits rows."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = (
        4 * spec.hidden_size
        + 2 * (spec.num_q_heads + 2 * spec.num_kv_heads) * spec.head_dim
        + 3 * spec.intermediate_size
    ) * itemsize
    longest = min(num_tokens, spec.max_position_embeddings or num_tokens)
    scores = spec.num_q_heads * longest * longest * 4
    logits = min(num_logits, num_tokens) * spec.vocab_size * (itemsize + 4)
    return int(num_tokens * per_token + scores + logits)


def cpu_kv_budget(memory_fraction: float, available_bytes: int, activation_bytes: int) -> int:
    """The CPU pool budget: ``memory_fraction`` of ``available_bytes`` (host RAM free now plus the current
    pool) less the activation estimate, capped at :data:`CPU_KV_BUDGET_CAP_BYTES`, never negative."""
    return max(0, int(min(memory_fraction * available_bytes - activation_bytes, CPU_KV_BUDGET_CAP_BYTES)))


def check_memory_fraction(memory_fraction: float) -> None:
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction={memory_fraction} is invalid: allowed (0, 1]")


def measure_copy_bandwidth(device: torch.device, num_bytes: int = 64 * 1024**2, repeats: int = 3) -> float:
    """Bytes per second of a device <-> CPU copy (the slower direction, best of ``repeats``).

    On CUDA this copies between device memory and pinned host memory, as swapping does; on CPU it is a
    host memcpy.
    """
    cuda = device.type == "cuda"
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=cuda)

    def best(dst: torch.Tensor, src: torch.Tensor) -> float:
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return num_bytes / max(min(times[1:]), 1e-9)

    return min(best(host, dev), best(dev, host))
