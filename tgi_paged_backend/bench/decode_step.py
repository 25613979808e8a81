"""The batches the forward benchmarks time (``examples/bench_forward.py``, ``bench_compiled_decode.py``).

Decode: ``rows`` requests with contexts drawn uniformly in [40, 200) from a seeded generator, one new token
each. Prefill: fresh prompts of 17-156 tokens (the peer burst's range) until ``tokens`` are reached. Each
request's blocks are consecutive from block 1 (block 0 stays the scratch block), so any runner whose pool
holds :attr:`DecodeStep.num_blocks` blocks can run it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tgi_paged_backend.runner.input_batch import ForwardBatch, build_forward_batch, on_consecutive_blocks


@dataclass(frozen=True, slots=True)
class DecodeStep:
    batch: ForwardBatch
    num_blocks: int
    """Pool blocks the batch needs (its blocks plus the scratch block 0)."""


def random_decode_step(rows: int, block_size: int, seed: int = 0) -> DecodeStep:
    """One decode step of ``rows`` requests (see the module docstring)."""
    lengths = np.random.default_rng(seed).integers(40, 200, size=rows)
    chunks, free = on_consecutive_blocks([([5], int(length) - 1) for length in lengths], block_size)
    return DecodeStep(build_forward_batch(chunks, block_size), free + 1)


def random_prefill_step(tokens: int, block_size: int, seed: int = 0) -> DecodeStep:
    """Fresh prompts of 17-156 random tokens, whole prompts until about ``tokens`` (one prefill step)."""
    rng = np.random.default_rng(seed)
    prompts: list[tuple[list[int], int]] = []
    total = 0
    while total < tokens:
        length = int(rng.integers(17, 156))
        prompts.append(([int(t) for t in rng.integers(10, 1000, size=length)], 0))
        total += length
    chunks, free = on_consecutive_blocks(prompts, block_size)
    return DecodeStep(build_forward_batch(chunks, block_size), free + 1)
