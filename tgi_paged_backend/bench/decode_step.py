"""The batches the forward benchmarks time (``examples/bench_forward.py``, ``bench_compiled_decode.py``).

Decode: ``rows`` requests with contexts drawn uniformly in [40, 200) from a seeded generator, one new token
each. Prefill: fresh prompts of 17-156 tokens (the peer burst's range) until ``tokens`` are reached. Each
request's blocks are consecutive from block 1 (block 0 stays the scratch block), so any runner whose pool
holds :attr:`DecodeStep.num_blocks` blocks can run it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tgi_paged_backend.runner.input_batch import ForwardBatch, RequestChunk, build_forward_batch


@dataclass(frozen=True, slots=True)
class DecodeStep:
    batch: ForwardBatch
    num_blocks: int
    """Pool blocks the batch needs (its blocks plus the scratch block 0)."""


def random_decode_step(rows: int, block_size: int, seed: int = 0) -> DecodeStep:
    """One decode step of ``rows`` requests (see the module docstring)."""
    lengths = np.random.default_rng(seed).integers(40, 200, size=rows)
    chunks, block = [], 1
    for length in lengths:
        n = -(-int(length) // block_size)
        chunks.append(RequestChunk([5], int(length) - 1, list(range(block, block + n))))
        block += n
    return DecodeStep(build_forward_batch(chunks, block_size), block + 1)


def random_prefill_step(tokens: int, block_size: int, seed: int = 0) -> DecodeStep:
    """Fresh prompts of 17-156 random tokens, whole prompts until about ``tokens`` (one prefill step)."""
    rng = np.random.default_rng(seed)
    chunks, block, total = [], 1, 0
    while total < tokens:
        length = int(rng.integers(17, 156))
        n = -(-length // block_size)
        chunks.append(
            RequestChunk([int(t) for t in rng.integers(10, 1000, size=length)], 0, list(range(block, block + n)))
        )
        block, total = block + n, total + length
    return DecodeStep(build_forward_batch(chunks, block_size), block + 1)
