"""Contiguous vs stock-TGI vs paged KV allocation on the same budget: the seed's table, with our numbers.

For each workload a seeded trace (default 1000 ShareGPT-like and 1000 Alpaca-like requests, all
arriving at once, ``max_new_tokens`` 1024 as clients set it) goes through the three allocators of
``tgi_paged_backend.planning.allocator_sim`` on the KV pool the capacity planner computes for the model
and GPU (default: Llama-3-8B shapes on an A10G 24 GB at memory fraction 0.9). The paged allocator is
the real ``KVCacheManager`` with the admission brake and preemption policies; it runs at several
overcommits and the advised one is reported. Step time is a roofline model of the GPU (``--unit-cost``
counts steps instead). No model, no GPU; well under a minute.

Usage::

    python examples/bench_allocators.py [--workloads sharegpt alpaca] [--requests 1000]
        [--model llama-3-8b | MODEL_DIR] [--gpu A10G] [--arrival burst|poisson --rate R]
        [--overcommits 1.5 2 3 4 6 8 12 16] [--out out/bench]

Writes ``allocators.json``, ``allocators_<workload>.png`` and the traces (``trace_<workload>.jsonl``)
to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tgi_paged_backend.bench.plots import plot_comparison  # noqa: E402
from tgi_paged_backend.planning.allocator_sim import compare  # noqa: E402
from tgi_paged_backend.planning.plan import PlanInputs  # noqa: E402
from tgi_paged_backend.planning.plan_report import format_plan  # noqa: E402
from tgi_paged_backend.planning.planner import make_plan  # noqa: E402
from tgi_paged_backend.planning.report import comparison_table, overcommit_table  # noqa: E402
from tgi_paged_backend.planning.sim_config import StepCostModel  # noqa: E402
from tgi_paged_backend.planning.workload import generate_trace, save_trace  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["sharegpt", "alpaca"])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--arrival", default="burst", choices=["burst", "poisson"])
    parser.add_argument("--rate", type=float, default=None, help="requests/s for poisson arrivals")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="client cap (default: the workload's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="llama-3-8b", help="preset name or local model directory")
    parser.add_argument("--gpu", default="A10G")
    parser.add_argument("--memory-fraction", type=float, default=0.90)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--overcommits", type=float, nargs="+", default=[1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0])
    parser.add_argument("--unit-cost", action="store_true", help="count steps instead of roofline seconds")
    parser.add_argument("--out", default="out/bench")
    args = parser.parse_args()

    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for workload in args.workloads:
        t1 = time.perf_counter()
        trace = generate_trace(
            workload,
            args.requests,
            arrival=args.arrival,
            rate=args.rate,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
        save_trace(out / f"trace_{workload}.jsonl", trace)
        inputs = PlanInputs(
            model=args.model,
            device=args.gpu,
            memory_fraction=args.memory_fraction,
            block_size=args.block_size,
            overcommits=tuple(args.overcommits),
        )
        plan = make_plan(inputs, trace)
        comparison, unit = plan.comparison, "s"
        if args.unit_cost:
            comparison = compare(trace, replace(plan.sim_config, cost=StepCostModel.unit()), args.overcommits)
            unit = "steps"
        print(f"=== {workload}: {args.requests} requests, {args.arrival} arrivals, {args.model} on {args.gpu} ===")
        if args.unit_cost:
            print(comparison_table(comparison, time_unit=unit))
            print()
            print(overcommit_table(comparison))
        else:
            print(format_plan(plan))
        png = plot_comparison(
            comparison,
            out / f"allocators_{workload}.png",
            time_unit=unit,
            title=f"{workload}: {args.requests} requests, {args.model} on {args.gpu}, "
            f"{plan.num_blocks} blocks x {args.block_size}",
        )
        results[workload] = {
            "plan": plan.to_dict(),
            "comparison": comparison.to_dict(series=False),
            "plot": str(png),
            "seconds": time.perf_counter() - t1,
        }
        print(f"\n(plot: {png}; {time.perf_counter() - t1:.1f} s)\n")
    (out / "allocators.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out / 'allocators.json'} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
