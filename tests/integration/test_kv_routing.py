"""Two replicas behind a router fed by their KV events versus round robin (issue 25): with multi-turn chats the
index sends each follow-up to the replica that holds its history, so far more prompt tokens come from
retained blocks. Prefix-hit rate is asserted (it does not depend on timing); TTFT is printed, not asserted."""

from __future__ import annotations

import time

import pytest

from integration.net import free_port
from tests.engine.conftest import make_engine

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from integration.kv_routing import KVIndex, index_router, round_robin, run_conversations  # noqa: E402

PODS = ("pod-a", "pod-b")


def _replicas(model_dir):
    ports = {pod: free_port() for pod in PODS}
    engines = {
        pod: make_engine(model_dir, num_blocks=96, block_size=8, TGI_PAGED_KV_EVENTS_ENDPOINT=f"tcp://*:{ports[pod]}")
        for pod in PODS
    }
    return engines, {pod: f"tcp://127.0.0.1:{port}" for pod, port in ports.items()}


def test_routing_by_the_kv_index_hits_more_prefix_than_round_robin(tiny_llama_dir) -> None:
    results = {}
    for policy in ("index", "round robin"):
        engines, endpoints = _replicas(tiny_llama_dir)
        index = KVIndex(endpoints, block_size=8)
        time.sleep(0.3)  # PUB/SUB: subscribed before the first event
        route = index_router(index, PODS) if policy == "index" else round_robin(PODS)
        tokenizer = engines[PODS[0]].prompt_tokenizer
        try:
            results[policy] = run_conversations(
                engines,
                lambda text, tok=tokenizer: tok.encode(text, 100_000, True),
                route,
                conversations=5,  # odd: round robin moves each conversation to the other replica every turn
                turns=3,
                max_new=6,
                settle=lambda: time.sleep(0.3),
            )
            if policy == "index":  # the index saw what the replicas hold
                assert any(index.held[pod] for pod in PODS)
        finally:
            index.close()
            for engine in engines.values():
                engine.close()
    (hit_index, ttft_index, n), (hit_rr, ttft_rr, _) = results["index"], results["round robin"]
    print(f"\n{n} requests: prefix hit rate index {hit_index:.1%} vs round robin {hit_rr:.1%}; "
          f"mean TTFT {ttft_index * 1e3:.1f} vs {ttft_rr * 1e3:.1f} ms")  # fmt: skip
    assert hit_index > hit_rr + 0.2
