"""Admitted concurrency of a multi-head latent attention pool against the same model with a key and a value per head.

Each row is one ``tgi-paged-backend plan`` (:func:`tgi_paged_backend.planning.planner.make_plan`) of a preset
(``deepseek-v3``, ``kimi-k2``) on ONE pool of the same bytes (``--kv-gib`` per rank), beside the same config with
the latent removed: ``num_key_value_heads`` = the query heads and ``head_dim`` = (192 + 128) / 2, so that a
token's K and V per head take what transformers' decompressed keys (qk_nope + qk_rope = 192) and values (128)
take. Shown: KV bytes per token (what the pool, Warmup and the planner count), the tokens the pool holds, and what
the allocator simulator predicts on that pool for a ShareGPT-like burst (peak and mean admitted requests,
simulated tokens/s from a roofline of the device). Analytic: nothing runs on a GPU.

    .venv/bin/python examples/bench_mla_concurrency.py [--gpu H200] [--kv-gib 40] [--requests 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tgi_paged_backend.planning.plan import PlanInputs  # noqa: E402
from tgi_paged_backend.planning.planner import make_plan  # noqa: E402
from tgi_paged_backend.planning.presets import PRESETS  # noqa: E402
from tgi_paged_backend.planning.report import table  # noqa: E402
from tgi_paged_backend.planning.workload import generate_trace  # noqa: E402

MODELS = ("deepseek-v3", "kimi-k2")


def per_head_config(preset: str) -> dict:
    """The preset without its latent: a key and a value per head, of the decompressed widths on average."""
    cfg = {k: v for k, v in PRESETS[preset].items() if k not in ("kv_lora_rank", "q_lora_rank")}
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg["head_dim"] = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) // 2
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="H200")
    parser.add_argument("--kv-gib", type=float, default=40.0, help="KV budget of the one pool (per rank)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--overcommit", type=float, default=2.0)
    args = parser.parse_args()
    trace = generate_trace("sharegpt", args.requests, seed=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in MODELS:
            per_head = Path(tmp) / preset
            per_head.mkdir()
            (per_head / "config.json").write_text(json.dumps(per_head_config(preset)))
            for label, model in (("latent (MLA)", preset), ("K + V per head", str(per_head))):
                inputs = PlanInputs(
                    model=model, device=args.gpu, kv_budget_bytes=int(args.kv_gib * 2**30),
                    overcommits=(args.overcommit,), num_shard=1,
                )  # fmt: skip
                plan = make_plan(inputs, trace)
                best = plan.comparison.best
                rows.append(
                    [
                        preset, label, f"{plan.bytes_per_token:,}", f"{plan.physical_tokens:,}",
                        str(best.peak_admitted), f"{best.mean_admitted:.1f}", f"{best.tokens_per_s:,.0f}",
                    ]
                )  # fmt: skip
    print(
        f"One pool of {args.kv_gib:g} GiB, {args.requests} ShareGPT-like requests in a burst, overcommit "
        f"{args.overcommit:g}, {args.gpu} roofline (bf16 KV):\n"
    )
    headers = ["model", "KV form", "bytes/token", "pool tokens", "peak admitted", "mean admitted", "sim tokens/s"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
