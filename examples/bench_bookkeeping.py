"""Per-decode-step bookkeeping cost of the KV cache manager (CPU only, no model).

One decode step for a batch does, for every request: ``allocate(request, position + 1)`` (a new
block every ``block_size`` tokens), then one ``decode_slot_mapping`` and one ``block_tables`` for
the whole batch. This script times exactly that for 256 requests at ~2048 tokens (128 blocks each
at block size 16) and prints the median and tail per step. Times are this thread's CPU time
(``time.thread_time_ns``), so other load on the machine does not inflate them. The batch is the same
every step, as in steady decode, so the block-table rows of the batch are looked up once and reused.

Usage::

    python examples/bench_bookkeeping.py [--requests 256] [--tokens 2048] [--steps 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tgi_paged_backend.memory import KVCacheManager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048, help="context length at the start of decode")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--aligned", action="store_true", help="all requests cross a block boundary on the same step (worst case)"
    )
    args = parser.parse_args()

    bs, num_requests = args.block_size, args.requests
    max_tokens = args.tokens + args.steps + bs
    num_blocks = num_requests * (-(-max_tokens // bs)) + 1
    kv = KVCacheManager(num_blocks=num_blocks, block_size=bs, enable_prefix_retention=False)
    rng = np.random.default_rng(0)
    # Stagger context lengths inside one block so block boundaries are spread over steps.
    offsets = np.zeros(num_requests, dtype=np.int64) if args.aligned else rng.integers(0, bs, num_requests)
    ids = [2**63 + i for i in range(num_requests)]  # u64-sized ids, as the router sends
    positions = np.full(num_requests, args.tokens - bs, dtype=np.int64) + offsets
    for request_id, length in zip(ids, positions.tolist()):
        kv.add_request(request_id)
        kv.match_prefix(request_id, [1] * length)
        assert kv.allocate(request_id, length) is not None

    step_ns: list[int] = []
    for _ in range(args.steps):
        t0 = time.thread_time_ns()
        for request_id, pos in zip(ids, positions.tolist()):
            if kv.allocate(request_id, pos + 1) is None:
                raise SystemExit("pool exhausted: bench sizing bug")
        slots = kv.decode_slot_mapping(ids, positions)
        tables = kv.block_tables(ids)
        step_ns.append(time.thread_time_ns() - t0)
        positions += 1
    assert slots.shape == (num_requests,) and tables.shape[0] == num_requests
    kv.check_invariants()

    ms = sorted(t / 1e6 for t in step_ns)
    print(
        f"config: requests={num_requests} context={args.tokens} (+{args.steps} decode steps) "
        f"block_size={bs} blocks/request~{tables.shape[1]} aligned={args.aligned}"
    )
    print(
        f"decode-step bookkeeping (allocate x{num_requests} + decode_slot_mapping + block_tables): "
        f"median {statistics.median(ms):.3f} ms, p90 {ms[int(0.9 * len(ms))]:.3f} ms, "
        f"max {ms[-1]:.3f} ms over {len(ms)} steps"
    )


if __name__ == "__main__":
    main()
