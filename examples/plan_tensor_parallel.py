"""Per-rank weights, KV and admitted concurrency of MoE models under ``--num-shard N`` on H100s.

Each row is one ``tgi-paged-backend plan`` (:func:`tgi_paged_backend.planning.planner.make_plan`) of a preset
at N ranks: the weights one rank holds (heads, MLP and experts split; embeddings, lm_head, norms and
routers whole), the KV bytes per token one rank stores (its KV heads; one replicated head when the model
has fewer KV heads than ranks), the pool that fits beside them, and what the allocator simulator predicts
on that pool for a ShareGPT-like burst: peak and mean admitted requests, stock TGI's bound (pool tokens
over the mean worst-case reservation) and simulated tokens/s (a roofline of the device, all-reduces not
modelled). Analytic: nothing runs on a GPU.

    .venv/bin/python examples/plan_tensor_parallel.py [--gpu H100] [--requests 2000] [--models mixtral-8x7b,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tgi_paged_backend.planning.plan import PlanInputs  # noqa: E402
from tgi_paged_backend.planning.planner import make_plan  # noqa: E402
from tgi_paged_backend.planning.report import fmt_bytes, table  # noqa: E402
from tgi_paged_backend.planning.workload import generate_trace  # noqa: E402

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-120b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--shards", default="1,2,4,8")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--overcommits", default="1.5,2,4")
    args = parser.parse_args()

    trace = generate_trace("sharegpt", args.requests, seed=0)
    overcommits = tuple(float(x) for x in args.overcommits.split(","))
    rows, refusals = [], []
    for model in args.models.split(","):
        for n in (int(x) for x in args.shards.split(",")):
            try:
                plan = make_plan(PlanInputs(model=model, device=args.gpu, num_shard=n, overcommits=overcommits), trace)
            except ValueError as err:
                rows.append([model, n, "does not fit", "", "", "", "", "", ""])
                refusals.append(f"{model} at N={n}: {err}")
                continue
            best, t = plan.comparison.best, plan.trace_summary
            rows.append(
                [
                    model,
                    n,
                    fmt_bytes(plan.weights_bytes),
                    f"{plan.bytes_per_token:,} ({plan.rank_spec.num_kv_heads})",
                    fmt_bytes(plan.kv_budget_bytes),
                    f"{plan.physical_tokens:,}",
                    f"{plan.physical_tokens / t['reserved_mean']:,.0f}",
                    f"{best.peak_admitted:,} / {best.mean_admitted:,.0f} (oc {plan.advised_overcommit:g})",
                    f"{best.tokens_per_s:,.0f}",
                ]
            )
    print(f"{args.gpu}, fp16 weights and KV, block 16, memory fraction 0.9; trace: sharegpt burst of {args.requests}")
    print(
        table(
            [
                "model",
                "N",
                "weights/rank",
                "KV B/token/rank (heads)",
                "KV budget/rank",
                "tokens that fit",
                "stock TGI bound",
                "admitted peak / mean",
                "sim tok/s",
            ],
            rows,
        )
    )
    print(
        f"admitted: the simulator's paged allocator at the advised overcommit; a peak near {args.requests} means the "
        "trace, not the pool, bounds it"
    )
    for line in refusals:
        print(line)


if __name__ == "__main__":
    main()
