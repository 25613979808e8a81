"""KV tiers (host RAM, disk) off vs on, side by side, in one run (issue 42's figures).

Report-only (never a CI gate). SmolLM2-135M-Instruct (float32), driven in-process through the router's
RPC sequence (Prefill, Decode until done, ClearCache), one request at a time; TTFT = the Prefill call's
wall time (tier loads and disk reads included). After the host's CPU model, ISA and load average:

- memory-bound: chats sharing a system prompt, several turns each (each turn re-sends the conversation
  plus a new user message), visited round robin; the pool holds 1/``--ratio`` of the final working set
  (``TGI_PAGED_NUM_BLOCKS``), the host tier (``TGI_PAGED_HOST_CACHE_GB``) the rest; TTFT p50/p90,
  generated tokens/s, prompt tokens served by each tier, the tier's copy traffic, same greedy tokens;
- control: the same chats on a pool that holds them all (goal: within 3 %);
- restart: the chats' turns, ``close()``, then each chat's next turn (its history a known prefix) on a fresh
  engine over the same ``TGI_PAGED_DISK_CACHE_DIR``, against a fresh engine without it (goal: TTFT >= 3x lower).

Off and on (cold and warm) alternate for ``--repeats`` rounds, fresh engines each; the best round of
each is shown. Figures move with the machine's load (printed).

Usage::

    python examples/bench_kv_tiers.py [--repeats 2] [--ratio 2.5] [--threads 2] [--json out/bench/kv_tiers.json]
    python examples/bench_kv_tiers.py --quick            # smoke test: 3 chats x 2 turns, one round
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

from tgi_paged_backend.bench.kv_tiers import Scenario, Workload, pool_scenario, restart_scenario  # noqa: E402
from tgi_paged_backend.planning.report import ratio, table  # noqa: E402

DRIVER = "in-process engine, router RPC sequence (Prefill / Decode / ClearCache), one request at a time"


def run(
    model_dir: Path, work: Workload, *, block_size: int = 16, mem_ratio: float = 2.5, repeats: int = 2
) -> list[Scenario]:
    return [
        pool_scenario(model_dir, work, name="memory-bound", ratio=mem_ratio, block_size=block_size, repeats=repeats),
        pool_scenario(model_dir, work, name="control", ratio=0.7, block_size=block_size, repeats=repeats),
        restart_scenario(model_dir, work, block_size=block_size, repeats=repeats),
    ]


def _ms(s: float) -> str:
    return f"{1000 * s:.1f}"


def format_scenario(sc: Scenario) -> str:
    a, b = ("cold", "warm") if sc.name == "restart" else ("off", "on")
    x, y = sc.best(a), sc.best(b)
    head = (
        f"{sc.name}: working set {sc.working_set_tokens} tokens, pool {sc.pool_tokens} tokens "
        f"({sc.working_set_tokens / sc.pool_tokens:.2f}x), host tier {sc.host_tokens} tokens; "
        f"{len(x.ttfts)} requests, {sc.settings['TGI_PAGED_BLOCK_SIZE']}-token blocks"
    )
    rows = [
        ["TTFT p50 (ms)", _ms(x.ttft(0.5)), _ms(y.ttft(0.5)), ratio(x.ttft(0.5), y.ttft(0.5))],
        ["TTFT p90 (ms)", _ms(x.ttft(0.9)), _ms(y.ttft(0.9)), ratio(x.ttft(0.9), y.ttft(0.9))],
        ["TTFT mean (ms)", _ms(sum(x.ttfts) / len(x.ttfts)), _ms(sum(y.ttfts) / len(y.ttfts)), ""],
        ["generated tok/s", f"{x.tokens_per_s:.1f}", f"{y.tokens_per_s:.1f}", ratio(y.tokens_per_s, x.tokens_per_s)],
        ["wall (s)", f"{x.wall_s:.2f}", f"{y.wall_s:.2f}", ""],
        ["TTFT, full blocks cached (ms)", _ms(x.floor_s), _ms(y.floor_s), ""],
        ["prompt tokens", x.prompt_tokens, y.prompt_tokens, ""],
    ]
    rows += [[f"hit tokens: {t}", x.hits.get(t, 0), y.hits.get(t, 0), ""] for t in ("pool", "host", "disk")]
    blocks = {"load": "loaded_blocks", "offload": "offloaded_blocks", "fetch": "fetched_blocks"}
    for label, key in (("load", "load"), ("offload", "offload"), ("disk fetch", "fetch")):
        if y.traffic.get(f"{key}_bytes"):
            mib, n = y.traffic[f"{key}_bytes"] / 2**20, y.traffic.get(blocks[key], 0) or 1
            per = f"{_ms(y.traffic[f'{key}_s'] / n)}/blk"
            rows.append(
                [f"{label} MiB / ms ({int(n)} blk)", "", f"{mib:.1f} / {_ms(y.traffic[f'{key}_s'])} ({per})", ""]
            )
    every = ", ".join(f"{r.mode} {r.wall_s:.2f}" for r in sc.runs)
    spread = {m: [r.wall_s for r in sc.runs if r.mode == m] for m in (a, b)}
    every += "; spread (max/min - 1) " + ", ".join(
        f"{m} {100 * (max(v) / min(v) - 1):.1f} %" for m, v in spread.items()
    )
    same = "identical" if sc.same_tokens(a, b) else "DIFFERENT"
    return "\n".join(
        [head, table(["", a, b, "ratio"], rows), f"greedy tokens {a} vs {b}: {same}; every round's wall s: {every}"]
    )


def goals(scenarios: list[Scenario]) -> list[str]:
    by = {sc.name: sc for sc in scenarios}
    out = []
    if "control" in by:
        off, on = by["control"].best("off"), by["control"].best("on")
        d = on.wall_s / off.wall_s - 1
        out.append(
            f"control: tier on {100 * d:+.1f} % wall vs off (goal within 3 %): {'met' if abs(d) <= 0.03 else 'missed'}"
        )
    if "restart" in by:
        cold, warm = by["restart"].best("cold"), by["restart"].best("warm")
        r = cold.ttft(0.5) / max(warm.ttft(0.5), 1e-9)
        out.append(f"restart: next-turn TTFT p50 {r:.2f}x lower warm (goal >= 3x): {'met' if r >= 3 else 'missed'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M via ensure_smollm2)")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=100)
    parser.add_argument("--user-words", type=int, default=40)
    parser.add_argument("--max-new", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--ratio", type=float, default=2.5, help="memory-bound: final working set / pool")
    parser.add_argument("--repeats", type=int, default=2, help="alternated off/on rounds (best shown)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 chats x 2 turns, 30-word prompts, 1 round")
    parser.add_argument("--json", default=None, help="also write every round here")
    args = parser.parse_args()

    import torch
    import transformers
    from loguru import logger

    from integration.peers.host import describe, host_info

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.quick:
        work = Workload(conversations=3, turns=2, system_words=30, user_words=12, max_new=4)
        args.repeats = 1
    else:
        work = Workload(args.conversations, args.turns, args.system_words, args.user_words, args.max_new)
    if args.model:
        model_dir = Path(args.model)
    else:
        from integration.smollm2 import ensure_smollm2

        model_dir = ensure_smollm2(progress=False)
    print(describe(host_info(), "float32"))
    print(f"model: {model_dir.name}; driver: {DRIVER}; torch threads {args.threads}")
    print(f"workload: {work}; repeats {args.repeats}\n")
    scenarios = run(model_dir, work, block_size=args.block_size, mem_ratio=args.ratio, repeats=args.repeats)
    for sc in scenarios:
        print(format_scenario(sc))
        print()
    for line in goals(scenarios):
        print(line)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([asdict(sc) for sc in scenarios], indent=1))
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
