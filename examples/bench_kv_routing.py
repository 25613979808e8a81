"""Two SmolLM2 replicas: routing by their KV events (a prefix-aware index) versus round robin, in one run.

Each policy gets two fresh engines in this process (each with ``TGI_PAGED_KV_EVENTS_ENDPOINT``, prefix
caching on) and the same multi-turn chats (``--conversations`` chats, odd so that round robin moves a chat
to the other replica every turn; ``--turns`` turns, each re-sending the conversation so far plus a
question; ``--max-new`` greedy tokens). The index (``integration/kv_routing.py``) keys blocks by its own
hash from the published token ids, as llm-d's indexer does, and routes each request to the replica
holding the longest prefix (new chats round robin). Printed: prefix-hit rate (prompt tokens served from
retained blocks) and mean time to first token (the prefill call that gave it), per policy.

    .venv/bin/python examples/bench_kv_routing.py [--conversations 9] [--turns 4] [--max-new 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from integration.kv_routing import KVIndex, index_router, round_robin, run_conversations  # noqa: E402
from integration.net import free_port  # noqa: E402
from integration.peers.host import describe, host_info  # noqa: E402
from integration.smollm2 import ensure_smollm2  # noqa: E402
from tgi_paged_backend.engine import build_engine  # noqa: E402
from tgi_paged_backend.envs import build_config  # noqa: E402

PODS = ("replica-a", "replica-b")
BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=9)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(describe(host_info(), "float32"))
    model = ensure_smollm2(progress=False)
    rows = []
    for policy in ("kv index", "round robin"):
        ports = {pod: free_port() for pod in PODS}
        engines = {
            pod: build_engine(
                build_config(
                    {"model_id": str(model)},
                    {
                        "TGI_PAGED_NUM_BLOCKS": "512",
                        "TGI_PAGED_BLOCK_SIZE": str(BLOCK_SIZE),
                        "PREFIX_CACHING": "1",
                        "TGI_PAGED_KV_EVENTS_ENDPOINT": f"tcp://*:{ports[pod]}",
                    },
                )
            )
            for pod in PODS
        }
        for engine in engines.values():
            engine.runner.warm_decode()  # as Warmup does: proves the native stack and direct decode
        index = KVIndex({pod: f"tcp://127.0.0.1:{port}" for pod, port in ports.items()}, BLOCK_SIZE)
        time.sleep(0.3)
        tokenizer = engines[PODS[0]].prompt_tokenizer
        route = index_router(index, PODS) if policy == "kv index" else round_robin(PODS)
        try:
            hit, ttft, n = run_conversations(
                engines,
                lambda text, tok=tokenizer: tok.encode(text, 100_000, True),
                route,
                conversations=args.conversations,
                turns=args.turns,
                max_new=args.max_new,
                settle=lambda: time.sleep(0.3),
            )
        finally:
            index.close()
            for engine in engines.values():
                engine.close()
        rows.append((policy, hit, ttft, n))
    print(f"\n{args.conversations} chats x {args.turns} turns, {args.max_new} new tokens per turn, 2 replicas")
    print(f"{'routing':14} {'requests':>8} {'prefix hit':>11} {'mean TTFT ms':>13}")
    for policy, hit, ttft, n in rows:
        print(f"{policy:14} {n:8d} {hit:10.1%} {ttft * 1e3:13.1f}")
    ratio = rows[1][2] / rows[0][2]
    print(f"mean TTFT, round robin / kv index: {ratio:.2f}x")


if __name__ == "__main__":
    main()
