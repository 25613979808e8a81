"""End to end on CPU with SmolLM2-135M: contiguous HF static batch vs stock-TGI mode vs paged.

One seeded trace (default: 24 requests of the ``tiny`` workload -- prompts ~24 tokens, answers ~20
tokens, ``max_new_tokens`` 96 as the client sets it -- all arriving at once) is served with the same
physical KV bytes three ways (see ``integration/bench_e2e/``):

1. contiguous: HF transformers static padded batches over a max-length cache;
2. stock-TGI mode: the real shard with ``TGI_PAGED_OVERCOMMIT=1`` behind the v3 router replay;
3. paged: the same shard with its defaults, at each ``--overcommits`` value.

Every shard mode runs at ``--block-size`` (default 1: token pages, which is what stock TGI 3.x does
by default -- flashinfer attention with prefix caching sets its ``BLOCK_SIZE`` to 1 -- so stock-TGI
mode is stock TGI's default, and the short answers of the ``tiny`` trace are not measured against
16-token pages sized for ~500-token ShareGPT requests; ``--block-size 16`` shows that case).

Prints a table (tokens/s, requests/s, TTFT and ITL p50/p99, peak concurrency, preemptions, recompute
tax, KV waste split), checks the targets, recommends an overcommit, and writes ``e2e.json`` and
``e2e.png`` to ``--out`` (default ``out/bench``, git-ignored). About 5-10 minutes on 2 cores.

Usage::

    python examples/bench_e2e.py [--requests 24] [--overcommits 3 4 6 8] [--kv-tokens 512] [--block-size 1]
        [--threads N] [--arrival burst|poisson --rate R] [--trace FILE.jsonl] [--out out/bench]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from integration.bench_e2e import E2EConfig, format_report, run_all, write_outputs  # noqa: E402
from tgi_paged_backend.planning.workload import generate_trace, load_trace, save_trace  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M via ensure_smollm2)")
    parser.add_argument("--trace", default=None, help="JSONL trace instead of the generator")
    parser.add_argument("--workload", default="tiny")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--arrival", default="burst", choices=["burst", "poisson"])
    parser.add_argument("--rate", type=float, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=512,
        help="KV token slots of every mode (TGI_PAGED_NUM_BLOCKS = kv_tokens / block_size + scratch)",
    )
    parser.add_argument("--num-blocks", type=int, default=None, help="TGI_PAGED_NUM_BLOCKS (incl. scratch) instead")
    parser.add_argument("--block-size", type=int, default=1)
    parser.add_argument("--overcommits", type=float, nargs="+", default=[3.0, 4.0, 6.0, 8.0])
    parser.add_argument("--max-input-tokens", type=int, default=128)
    parser.add_argument("--max-batch-prefill-tokens", type=int, default=256)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per mode (0: torch's default); 1 keeps a shared 2-core box stable",
    )
    parser.add_argument("--skip-contiguous", action="store_true")
    parser.add_argument("--skip-stock", action="store_true")
    parser.add_argument("--out", default="out/bench")
    args = parser.parse_args()

    t0 = time.perf_counter()
    if args.model:
        model_dir = Path(args.model)
    else:
        from integration.smollm2 import ensure_smollm2

        model_dir = ensure_smollm2()
    if args.trace:
        trace = load_trace(args.trace, default_max_new_tokens=args.max_new_tokens or 96)
    else:
        trace = generate_trace(
            args.workload,
            args.requests,
            arrival=args.arrival,
            rate=args.rate,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
    out = Path(args.out)
    save_trace(out / "e2e_trace.jsonl", trace)
    num_blocks = args.num_blocks or -(-args.kv_tokens // args.block_size) + 1
    cfg = E2EConfig(
        model_dir=model_dir,
        trace=tuple(trace),
        num_blocks=num_blocks,
        block_size=args.block_size,
        overcommits=tuple(args.overcommits),
        max_input_tokens=args.max_input_tokens,
        max_batch_prefill_tokens=args.max_batch_prefill_tokens,
        threads=args.threads or None,
        run_contiguous=not args.skip_contiguous,
        run_stock=not args.skip_stock,
        seed=args.seed,
    )
    report = run_all(cfg)
    print()
    print(format_report(report))
    js, png = write_outputs(report, out)
    print(f"\nwrote {js} and {png} ({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
