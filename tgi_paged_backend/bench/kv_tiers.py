"""KV tiers off vs on (issue 42's figures): multi-turn conversations on a pool smaller than their prefixes.

In-process, one request at a time through the router's RPC sequence (Prefill, then Decode until the
request finishes, ClearCache of the emptied batch): a request's TTFT is its Prefill call's wall time,
which includes the tier's load copies (they run in the step's copy list) and the disk reads at
admission. Scenarios:

- ``memory-bound``: ``conversations`` chats sharing a system prompt, ``turns`` turns each (a turn
  re-sends the conversation so far plus a new user message and appends the greedy answer), visited
  round robin; the pool (``TGI_PAGED_NUM_BLOCKS``) holds ``1 / ratio`` of the final working set, the
  host tier (``TGI_PAGED_HOST_CACHE_GB``, sized from the pool's block bytes) the rest with room to spare;
- ``control``: the same chats on a pool that holds them all (the tier has nothing to do: its overhead);
- ``restart``: the chats' turns on an engine with a disk tier; ``close()`` persists; a fresh engine over
  the same directory serves each chat's next turn (its history is a known prefix), against a fresh engine
  without one (cold).

Off and on alternate for ``repeats`` rounds (fresh engines each) so that a shared machine's load hits
both alike; the best round of each (shortest wall time) is reported, every round kept.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tgi_paged_backend.engine.types import BatchSpec, RequestSpec, StoppingParams

WORDS = (
    "the cache keeps every block of a prompt that the pool can hold and the host tier keeps the rest while "
    "a router sends each turn of a chat with the whole conversation again so a server that remembers the "
    "prefix answers sooner than one that computes it from the first token to the last one"
).split()


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: int = 6
    turns: int = 4
    system_words: int = 100
    user_words: int = 40
    max_new: int = 16
    seed: int = 0

    def system_prompt(self) -> str:
        rng = random.Random(self.seed)
        return "System: " + " ".join(rng.choice(WORDS) for _ in range(self.system_words)) + "\n"

    def user_message(self, conversation: int, turn: int) -> str:
        rng = random.Random(f"{self.seed}/{conversation}/{turn}")
        return (
            f"User {conversation}.{turn}: "
            + " ".join(rng.choice(WORDS) for _ in range(self.user_words))
            + "\nAssistant:"
        )


@dataclass(slots=True)
class Run:
    """One engine's pass over a scenario."""

    mode: str
    """``off`` / ``on`` (tier), ``cold`` / ``warm`` (restart)."""
    ttfts: list[float] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    wall_s: float = 0.0
    prompt_tokens: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    """Prompt tokens served from each tier: ``pool``, ``host``, ``disk``."""
    traffic: dict[str, float] = field(default_factory=dict)
    """The engine's ``tier_io.traffic`` (bytes and seconds each way), plus ``loaded_blocks`` /
    ``offloaded_blocks`` (anchor blocks) from the tier's counters."""
    floor_s: float = 0.0
    """TTFT of the last prompt sent again at once (every full block in the pool): one forward's fixed cost."""

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    def ttft(self, q: float) -> float:
        xs = sorted(self.ttfts)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s else 0.0


@dataclass(slots=True)
class Scenario:
    name: str
    settings: dict[str, str]
    """The knobs both sides share (pool, block size); the tier's are in ``runs``' engines."""
    working_set_tokens: int
    pool_tokens: int
    host_tokens: int
    runs: list[Run] = field(default_factory=list)

    def best(self, mode: str) -> Run:
        return min((r for r in self.runs if r.mode == mode), key=lambda r: r.wall_s)

    def same_tokens(self, a: str, b: str) -> bool:
        want = self.runs[0].tokens if self.runs[0].mode == a else self.best(a).tokens
        return all(r.tokens == want for r in self.runs if r.mode in (a, b))


def build(model_dir: Path, settings: dict[str, str]) -> Any:
    from tgi_paged_backend.engine import build_engine
    from tgi_paged_backend.envs import build_config
    from tgi_paged_backend.model_files import with_local_model

    return build_engine(with_local_model(build_config({"model_id": str(model_dir)}, settings)))


def serve(engine: Any, rid: int, text: str, max_new: int) -> tuple[float, list[int], str]:
    """One request through Prefill / Decode / ClearCache; returns (TTFT s, token ids, generated text)."""
    spec = RequestSpec(
        id=rid, text=text, truncate=1_000_000, stopping=StoppingParams(max_new_tokens=max_new, ignore_eos_token=True)
    )
    start = time.perf_counter()
    result = engine.prefill(BatchSpec(id=rid, requests=(spec,)), None)
    ttft = time.perf_counter() - start
    ids: list[int] = []
    texts: list[str] = []
    while True:
        done = False
        for g in result.generations:
            ids.extend(g.tokens.ids)
            texts.extend(g.tokens.texts)
            done = done or g.generated_text is not None
        if result.batch is None:
            break
        if done:
            engine.clear_cache(result.batch.id)
            break
        result = engine.decode([result.batch.id])
    return ttft, ids, "".join(texts)


def warm_up(engine: Any) -> None:
    """One unrelated request first: the first call's one-time costs are nobody's TTFT."""
    serve(engine, 10**9, "Warm-up: hello there, how are you today?", 2)


def _collect(engine: Any, run: Run, hits_before: tuple[int, int, int]) -> None:
    total = engine.stats.prefix_hit_tokens - hits_before[0]
    disk = engine.stats.disk_hit_tokens - hits_before[1]
    loaded = 0
    if engine.kv.tiers is not None:
        loaded = (engine.kv.tiers.counters.loaded_blocks - hits_before[2]) * engine.block_size
    run.hits = {"pool": total - loaded, "host": max(0, loaded - disk), "disk": disk}
    t = engine.tier_io.traffic if engine.tier_io is not None else None
    if t is not None:
        run.traffic = {k: float(getattr(t, k)) for k in t.__dataclass_fields__}
    if engine.kv.tiers is not None:
        c = engine.kv.tiers.counters
        run.traffic |= {"loaded_blocks": float(c.loaded_blocks), "offloaded_blocks": float(c.offloaded_blocks)}


def _marks(engine: Any) -> tuple[int, int, int]:
    loaded = engine.kv.tiers.counters.loaded_blocks if engine.kv.tiers is not None else 0
    return engine.stats.prefix_hit_tokens, engine.stats.disk_hit_tokens, loaded


def converse(engine: Any, work: Workload, mode: str, turns: int | None = None, history: list[str] | None = None) -> Run:
    """Every conversation's turns, round robin (turn 1 of each, then turn 2 of each, ...); ``history``:
    the conversations so far (extended in place; default: the system prompt only), the turns go on from
    its turn count."""
    warm_up(engine)
    marks = _marks(engine)
    run = Run(mode)
    if history is None:
        history = [work.system_prompt() for _ in range(work.conversations)]
    first = history[0].count("\nAssistant:")
    start = time.perf_counter()
    rid, last = 1, ""
    for turn in range(first, first + (work.turns if turns is None else turns)):
        for c in range(work.conversations):
            history[c] += work.user_message(c, turn)
            run.prompt_tokens += len(engine.prompt_tokenizer.encode(history[c], 1_000_000, True))
            last = history[c]
            ttft, ids, text = serve(engine, rid, last, work.max_new)
            run.ttfts.append(ttft)
            run.tokens[rid] = ids
            history[c] += text + "\n"
            rid += 1
    run.wall_s = time.perf_counter() - start
    _collect(engine, run, marks)
    run.floor_s = serve(engine, rid, last, 1)[0]  # the last prompt again: its full blocks are in the pool
    return run


def host_gb(blocks: int, block_bytes: int) -> str:
    return f"{blocks * block_bytes / 2**30 * 1.0001:.12f}"


def working_set_tokens(model_dir: Path, work: Workload, block_size: int) -> tuple[int, int, int]:
    """(final working set in tokens, longest prompt + answer, one block's bytes), from a probe engine."""
    probe = build(model_dir, {"TGI_PAGED_NUM_BLOCKS": "64", "TGI_PAGED_BLOCK_SIZE": str(block_size)})
    try:
        enc = probe.prompt_tokenizer.encode
        system = len(enc(work.system_prompt(), 1_000_000, True))
        per_turn = [
            sum(len(enc(work.user_message(c, t), 1_000_000, False)) + work.max_new + 1 for t in range(work.turns))
            for c in range(work.conversations)
        ]
        return system + sum(per_turn), system + max(per_turn), probe.runner.pool.block_bytes
    finally:
        probe.close()


def pool_scenario(
    model_dir: Path, work: Workload, *, name: str, ratio: float, block_size: int, repeats: int, host_spare: float = 1.5
) -> Scenario:
    """Off / on alternated on a pool of ``working set / ratio`` (never below the longest request)."""
    ws, longest, block_bytes = working_set_tokens(model_dir, work, block_size)
    pool_blocks = max(-(-int(ws / ratio) // block_size), -(-longest // block_size) + 2)
    host_blocks = int(-(-ws // block_size) * host_spare)
    base = {
        "TGI_PAGED_NUM_BLOCKS": str(pool_blocks + 1),
        "TGI_PAGED_BLOCK_SIZE": str(block_size),
        "PREFIX_CACHING": "1",
    }
    sc = Scenario(name, base, ws, pool_blocks * block_size, host_blocks * block_size)
    for _ in range(repeats):
        for mode in ("off", "on"):
            gb = host_gb(host_blocks, block_bytes) if mode == "on" else "0"
            engine = build(model_dir, {**base, "TGI_PAGED_HOST_CACHE_GB": gb})
            try:
                sc.runs.append(converse(engine, work, mode))
            finally:
                engine.close()
    return sc


def restart_scenario(
    model_dir: Path, work: Workload, *, block_size: int, repeats: int, host_blocks: int = 256
) -> Scenario:
    """The turn after a restart: every conversation's ``work.turns`` turns on an engine with a disk tier,
    ``close()`` (persists), then each conversation's next turn (its whole history re-sent, a known prefix)
    on a fresh engine over the same directory (warm) vs a fresh engine without one (cold)."""
    ws, _, block_bytes = working_set_tokens(model_dir, work, block_size)
    base = {"TGI_PAGED_NUM_BLOCKS": "256", "TGI_PAGED_BLOCK_SIZE": str(block_size), "PREFIX_CACHING": "1"}
    tier = {**base, "TGI_PAGED_HOST_CACHE_GB": host_gb(host_blocks, block_bytes)}
    sc = Scenario("restart", base, ws, 255 * block_size, host_blocks * block_size)
    with tempfile.TemporaryDirectory(prefix="kv-tiers-") as tmp:
        disk = {**tier, "TGI_PAGED_DISK_CACHE_DIR": tmp}
        first = build(model_dir, disk)
        history = [work.system_prompt() for _ in range(work.conversations)]
        try:
            converse(first, work, "seed", history=history)
        finally:
            first.close()  # persists the pool's retained blocks
        for _ in range(repeats):
            for mode in ("cold", "warm"):
                engine = build(model_dir, disk if mode == "warm" else tier)
                try:
                    sc.runs.append(converse(engine, work, mode, turns=1, history=list(history)))
                finally:
                    engine.close()
    return sc
