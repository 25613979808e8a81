"""Two replicas behind a prefix-aware router fed by their KV events, versus round robin (issue 25).

:class:`KVIndex` is a router-side index written from the published format alone, as llm-d's indexer
works: it subscribes to every replica's events, keys each stored block by its *own* hash of the parent's
key and the block's tokens (and adapter), never by the engine's hash, and answers "which replica holds the
longest prefix of these tokens". :func:`run_conversations` plays multi-turn chats (each turn re-sends the
conversation so far) against in-process engines, routing each request by the index or round robin, and
reports the prefix-hit rate and the mean time to first token. Used by
``tests/integration/test_kv_routing.py`` and ``examples/bench_kv_routing.py``.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from tgi_paged_backend.engine.types import BatchSpec, RequestSpec, StoppingParams


def _key(parent: int, tokens: Sequence[int], adapter: str | None) -> int:
    """The router's own block key (64 bits of SHA-256 over parent, adapter and tokens)."""
    digest = hashlib.sha256(repr((parent, adapter, tuple(tokens))).encode()).digest()
    return int.from_bytes(digest[:8], "big")


class KVIndex:
    """Blocks held per replica, from their KV events (one SUB socket per replica, one thread)."""

    def __init__(self, endpoints: dict[str, str], block_size: int) -> None:
        self.block_size = block_size
        self.held: dict[str, set[int]] = {pod: set() for pod in endpoints}
        self._engine_to_key: dict[str, dict[int, int]] = {pod: {} for pod in endpoints}
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._sockets = {}
        for pod, endpoint in endpoints.items():
            sub = self._context.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            self._sockets[pod] = sub
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sub in self._sockets.values():
            poller.register(sub, zmq.POLLIN)
        by_socket = {sub: pod for pod, sub in self._sockets.items()}
        while not self._stop.is_set():
            for sub, _ in poller.poll(50):
                _, _, payload = sub.recv_multipart()
                self._apply(by_socket[sub], payload)

    def _apply(self, pod: str, payload: bytes) -> None:
        _, events, _ = msgpack.unpackb(payload, raw=False)
        with self._lock:
            keys, held = self._engine_to_key[pod], self.held[pod]
            for event in events:
                if event[0] == "BlockStored":
                    (block_hash,), parent, tokens, _, _, _, lora_name = event[1:8]
                    parent_key = 0 if parent is None else keys.get(parent)
                    if parent_key is None:  # parent unknown (missed): skip, as llm-d does
                        continue
                    key = _key(parent_key, tokens, lora_name)
                    keys[block_hash] = key
                    held.add(key)
                elif event[0] == "BlockRemoved":
                    key = keys.pop(event[1][0], None)
                    if key is not None:
                        held.discard(key)
                else:
                    keys.clear()
                    held.clear()

    def prefix_blocks(self, pod: str, token_ids: Sequence[int], adapter: str | None = None) -> int:
        """How many leading full blocks of ``token_ids`` ``pod`` holds."""
        n, parent = 0, 0
        with self._lock:
            held = self.held[pod]
            for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
                parent = _key(parent, token_ids[start : start + self.block_size], adapter)
                if parent not in held:
                    break
                n += 1
        return n

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._context.destroy(linger=0)


@dataclass
class RoutingResult:
    policy: str
    prefix_hit_rate: float
    """Prompt tokens served from retained blocks over prompt tokens, all replicas."""
    mean_ttft_s: float
    """Mean over requests of the prefill call that gave their first token."""
    requests: int


def run_conversations(
    engines: dict[str, Any],
    encode: Callable[[str], list[int]],
    route: Callable[[int, list[int]], str],
    *,
    conversations: int,
    turns: int,
    max_new: int,
    seed: int = 0,
    words: Sequence[str] = ("alpha", "beta", "gamma", "delta", "memory", "block", "cache", "router"),
    settle: Callable[[], None] = lambda: None,
) -> tuple[float, float, int]:
    """Multi-turn chats, each turn one request per conversation routed by ``route(conversation, prompt ids)``.

    Returns (prefix-hit rate, mean TTFT, requests). Each turn's requests go to their replicas as one
    prefill batch per replica (run one replica after the other in this process; a request's TTFT is its
    replica's prefill call), then decode to the end; ``settle`` runs between turns (event delivery).
    """
    rng = random.Random(seed)
    history = [" ".join(rng.choice(words) for _ in range(40 + 10 * c % 30)) for c in range(conversations)]
    before = {pod: (e.stats.prefix_hit_tokens, e.stats.prefix_query_tokens) for pod, e in engines.items()}
    ttfts: list[float] = []
    next_id = 1
    for turn in range(turns):
        by_pod: dict[str, list[tuple[int, RequestSpec]]] = {pod: [] for pod in engines}
        for c in range(conversations):
            text = history[c] + f" turn {turn} question {rng.choice(words)}"
            history[c] = text
            spec = RequestSpec(
                id=next_id,
                text=text,
                truncate=100_000,
                stopping=StoppingParams(max_new_tokens=max_new, ignore_eos_token=True),
            )
            next_id += 1
            by_pod[route(c, encode(text))].append((c, spec))
        for pod, items in by_pod.items():
            if not items:
                continue
            engine = engines[pod]
            start = time.perf_counter()
            result = engine.prefill(BatchSpec(id=1000 + turn, requests=tuple(s for _, s in items)), None)
            ttfts.extend([time.perf_counter() - start] * len(items))
            texts = {s.id: "" for _, s in items}
            while True:
                for g in result.generations:
                    texts[g.request_id] += "".join(g.tokens.texts)
                if result.batch is None:
                    break
                result = engine.decode([result.batch.id])
            for c, s in items:
                history[c] += texts[s.id]
        settle()
    hit = sum(e.stats.prefix_hit_tokens - before[p][0] for p, e in engines.items())
    query = sum(e.stats.prefix_query_tokens - before[p][1] for p, e in engines.items())
    return hit / max(query, 1), statistics.fmean(ttfts), len(ttfts)


def index_router(index: KVIndex, pods: Sequence[str]) -> Callable[[int, list[int]], str]:
    """Route to the replica holding the longest prefix; ties (a new conversation) go round robin."""
    turn = {"n": 0}

    def route(conversation: int, token_ids: list[int]) -> str:
        scores = [(index.prefix_blocks(pod, token_ids), pod) for pod in pods]
        best = max(score for score, _ in scores)
        if best == 0:
            turn["n"] += 1
            return pods[turn["n"] % len(pods)]
        return next(pod for score, pod in scores if score == best)

    return route


def round_robin(pods: Sequence[str]) -> Callable[[int, list[int]], str]:
    """Each request to the next replica in turn, whatever it holds."""
    turn = {"n": 0}

    def route(conversation: int, token_ids: list[int]) -> str:
        turn["n"] += 1
        return pods[turn["n"] % len(pods)]

    return route
