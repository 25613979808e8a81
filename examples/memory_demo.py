"""Worst-case reservations (stock TGI) vs lazy physical blocks with preemption (this backend).

A burst of requests with a generous ``max_new_tokens`` but mostly short real outputs is served on
the same physical KV pool twice, one token per running request per step (prompts prefill in one
step):

- **stock**: the router reserves ``input + max_new_tokens - 1`` slots per request out of the
  physical pool, and the shard backs every reserved block at once. No preemption.
- **paged**: the router reserves the same worst case, but out of an overcommitted *virtual* pool;
  the shard maps physical blocks only as tokens are written, brakes admission below the watermark,
  and preempts the latest admitted request (swap or recompute, by cost) when the pool runs dry.

It prints physical usage, the waste split (internal / reservation / external), concurrency against
what worst-case reservations allow, preemptions, and steps to drain the burst. No model, no GPU;
it runs in a few seconds.

Usage::

    python examples/memory_demo.py [--requests 300] [--blocks 1024] [--overcommit 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tgi_paged_backend.memory import KVCacheManager
from tgi_paged_backend.policy.admission import should_brake
from tgi_paged_backend.policy.preemption_mode import RateCalibrator, choose_preemption_mode
from tgi_paged_backend.policy.victims import VictimCandidate, victim_order

BLOCK_BYTES = 32 * 2 * 8 * 128 * 2 * 16
"""K+V bytes of one 16-token block of an 8B Llama-class model (32 layers, 8 KV heads x 128, fp16)."""


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    output_len: int
    history: list[int] = field(default_factory=list)
    virtual: tuple[int, ...] = ()
    seq: int = 0
    state: str = "queued"  # queued | running | waiting | swapped | dropped | done
    num_preemptions: int = 0

    @property
    def reservation_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def num_generated(self) -> int:
        return len(self.history) - len(self.prompt)


class RouterPool:
    """The router's block allocator: a free list of (virtual) block ids; block 0 never handed out."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, 0, -1))

    def reserve(self, num_tokens: int) -> tuple[int, ...] | None:
        num = -(-num_tokens // self.block_size)
        if num > len(self.free):
            return None
        return tuple(self.free.pop() for _ in range(num))

    def release(self, blocks: tuple[int, ...]) -> None:
        self.free.extend(blocks)


@dataclass
class Tally:
    """Per-step samples, averaged at the end."""

    steps: int = 0
    used: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    internal: list[int] = field(default_factory=list)
    reserved_physical: list[int] = field(default_factory=list)
    reserved_virtual: list[int] = field(default_factory=list)
    external: list[int] = field(default_factory=list)
    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    recomputed_tokens: int = 0
    swapped_blocks: int = 0

    def sample(self, kv: KVCacheManager, running: list[Request], num_pending_blocks: int) -> None:
        bs = kv.block_size
        written_blocks = sum(-(-len(r.history) // bs) for r in running)
        stats = kv.stats(num_pending_blocks)
        self.used.append(kv.num_used_blocks)
        self.running.append(len(running))
        self.internal.append(sum(-(-len(r.history) // bs) * bs - len(r.history) for r in running))
        self.reserved_physical.append(max(kv.num_used_blocks - written_blocks, 0) * bs)
        self.reserved_virtual.append(stats.reservation_waste_slots)
        self.external.append(stats.external_waste_blocks)


def make_workload(num_requests: int, seed: int) -> list[Request]:
    """Prompts of 32-512 tokens, max_new_tokens 512, real outputs mostly short (mean ~128)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_requests):
        prompt = rng.integers(3, 32_000, int(rng.integers(32, 513))).tolist()
        output_len = int(np.clip(rng.exponential(128), 8, 512))
        out.append(Request(i, prompt, 512, output_len))
    return out


def _decode_one(kv: KVCacheManager, r: Request, rng: np.random.Generator) -> None:
    r.history.append(int(rng.integers(3, 32_000)))
    kv.commit_tokens(r.id, r.history)


def run_stock(workload: list[Request], num_blocks: int, block_size: int, seed: int) -> Tally:
    """Stock TGI: physical = the router's worst-case reservation, admitted FIFO, no preemption."""
    rng = np.random.default_rng(seed + 1)
    kv = KVCacheManager(num_blocks=num_blocks + 1, block_size=block_size, enable_prefix_retention=False)
    router = RouterPool(num_blocks + 1, block_size)
    queue, running, tally = deque(workload), [], Tally()
    while queue or running:
        pending = 0
        while queue:
            r = queue[0]
            virtual = router.reserve(r.reservation_tokens)
            if virtual is None:
                pending = -(-r.reservation_tokens // block_size)  # head of line waits
                break
            queue.popleft()
            r.virtual, r.history, r.state = virtual, list(r.prompt), "running"
            kv.add_request(r.id, virtual)
            assert kv.allocate(r.id, len(virtual) * block_size) is not None  # back the whole reservation
            kv.commit_tokens(r.id, r.history)
            running.append(r)
        for r in running:
            _decode_one(kv, r, rng)
        tally.sample(kv, running, pending)
        for r in [r for r in running if r.num_generated >= r.output_len]:
            kv.free(r.id)
            router.release(r.virtual)
            running.remove(r)
        tally.steps += 1
    return tally


class PagedSim:
    """This backend: overcommitted virtual pool, lazy physical blocks, brake and preemption."""

    def __init__(
        self, num_blocks: int, block_size: int, overcommit: float, num_swap_blocks: int, watermark: float, seed: int
    ) -> None:
        self.kv = KVCacheManager(num_blocks=num_blocks + 1, block_size=block_size, num_swap_blocks=num_swap_blocks)
        self.router = RouterPool(int(num_blocks * overcommit) + 1, block_size)
        self.watermark = watermark
        self.calibrator = RateCalibrator()
        self.rng = np.random.default_rng(seed + 1)
        self.live: list[Request] = []  # admitted, in admission order
        self.tally = Tally()
        self.next_seq = 0

    def _start(self, r: Request) -> bool:
        """(Re)prefill the whole history; ``False`` when the pool cannot back it now."""
        kv = self.kv
        if r.state in ("queued", "dropped"):
            kv.match_prefix(r.id, r.history)
            r.state = "waiting"
        if kv.allocate(r.id, len(r.history)) is None:
            return False
        kv.commit_tokens(r.id, r.history)
        r.state = "running"
        return True

    def _preempt(self, victim: Request) -> None:
        memory = self.kv.request_memory(victim.id)
        decision = choose_preemption_mode(
            "auto",
            num_tokens_to_reprefill=len(victim.history),
            num_swap_bytes=memory.num_blocks * BLOCK_BYTES,
            swap_has_room=self.kv.can_swap_out(victim.id),
            calibrator=self.calibrator,
        )
        if decision.mode == "swap" and (plan := self.kv.swap_out(victim.id)) is not None:
            victim.state = "swapped"
            self.tally.swapped_blocks += plan.num_blocks
        else:
            decision = choose_preemption_mode(
                "recompute",
                num_tokens_to_reprefill=len(victim.history),
                num_swap_bytes=0,
                swap_has_room=False,
                calibrator=self.calibrator,
            )
            self.tally.recomputed_tokens += self.kv.preempt_recompute(victim.id)
            victim.state = "dropped"
        victim.num_preemptions += 1
        self.tally.preemptions[decision.mode] += 1

    def _make_room(self, needy: Request) -> bool:
        """Preempt one running request admitted after ``needy`` (policy order)."""
        candidates = [
            VictimCandidate(v.id, v.seq, v.num_preemptions, self.kv.request_memory(v.id).num_exclusive_blocks)
            for v in self.live
            if v.state == "running" and v.seq > needy.seq
        ]
        order = victim_order(candidates, max_preemptions=8)
        if not order:
            return False
        self._preempt(next(v for v in self.live if v.id == order[0].request_id))
        return True

    def step(self, queue: deque[Request]) -> None:
        kv, pending = self.kv, 0
        # 1. Preempted requests resume first, oldest first.
        for r in [r for r in self.live if r.state in ("swapped", "dropped", "waiting")]:
            if r.state == "swapped":
                if kv.swap_in(r.id) is None:
                    pending = kv.request_memory(r.id).num_blocks
                    break
                r.state = "running"
            elif not self._start(r):
                pending = kv.blocks_needed(r.id, len(r.history))
                break
        # 2. The router admits while its virtual pool has room and the shard does not brake.
        waiting = sum(r.state != "running" for r in self.live)
        while queue and not should_brake(kv.num_available_blocks, kv.num_total_blocks, self.watermark, waiting):
            r = queue[0]
            virtual = self.router.reserve(r.reservation_tokens)
            if virtual is None:
                break
            queue.popleft()
            r.virtual, r.history, r.seq = virtual, list(r.prompt), self.next_seq
            self.next_seq += 1
            kv.add_request(r.id, virtual)
            self.live.append(r)
            if not self._start(r):
                waiting += 1
        # 3. Decode one token per running request, oldest first, preempting later ones if needed.
        for r in list(self.live):
            if r.state != "running":
                continue
            while kv.allocate(r.id, len(r.history) + 1) is None:
                if not self._make_room(r):
                    self._preempt(r)  # the newest request gives way itself
                    break
            if r.state == "running":
                _decode_one(kv, r, self.rng)
        running = [r for r in self.live if r.state == "running"]
        self.tally.sample(kv, running, pending)
        for r in [r for r in running if r.num_generated >= r.output_len]:
            kv.free(r.id)
            self.router.release(r.virtual)
            self.live.remove(r)
        self.tally.steps += 1


def run_paged(workload: list[Request], num_blocks: int, block_size: int, overcommit: float, seed: int) -> Tally:
    sim = PagedSim(num_blocks, block_size, overcommit, num_swap_blocks=num_blocks // 4, watermark=0.01, seed=seed)
    queue = deque(workload)
    while queue or sim.live:
        sim.step(queue)
    sim.kv.check_invariants()
    return sim.tally


def report(
    workload: list[Request], num_blocks: int, block_size: int, overcommit: float, stock: Tally, paged: Tally
) -> None:
    slots = num_blocks * block_size
    worst = np.mean([-(-r.reservation_tokens // block_size) for r in workload])

    def pct(values: list[int], denominator: float) -> str:
        return f"{100 * np.mean(values) / denominator:5.1f} %"

    rows = [
        ("physical blocks used (mean / peak)", lambda t: f"{np.mean(t.used):6.0f} / {max(t.used)}"),
        ("waste: internal (last-block tails)", lambda t: pct(t.internal, slots)),
        ("waste: reservation held physically", lambda t: pct(t.reserved_physical, slots)),
        ("reservation that is virtual only", lambda t: pct(t.reserved_virtual, slots)),
        ("waste: external (stranded blocks)", lambda t: pct(t.external, num_blocks)),
        ("running requests (mean / peak)", lambda t: f"{np.mean(t.running):6.1f} / {max(t.running)}"),
        ("preemptions (recompute / swap)", lambda t: f"{t.preemptions['recompute']} / {t.preemptions['swap']}"),
        ("recomputed tokens / swapped blocks", lambda t: f"{t.recomputed_tokens} / {t.swapped_blocks}"),
        ("steps to drain the burst", lambda t: str(t.steps)),
    ]
    print(
        f"workload: {len(workload)} requests, prompts 32-512 tokens, max_new_tokens 512, "
        f"real outputs mean {np.mean([r.output_len for r in workload]):.0f} tokens"
    )
    print(
        f"pool: {num_blocks} physical blocks x {block_size} tokens; worst-case reservation "
        f"{worst:.1f} blocks/request -> at most {num_blocks / worst:.1f} concurrent under stock TGI; "
        f"paged overcommit {overcommit:g}x"
    )
    print("(waste in % of pool slots, time-averaged over steps)\n")
    print(f"{'':38s}{'stock TGI':>18s}{'paged':>18s}")
    for label, fmt in rows:
        print(f"{label:38s}{fmt(stock):>18s}{fmt(paged):>18s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=1024, help="physical blocks in the pool")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--overcommit", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    stock = run_stock(make_workload(args.requests, args.seed), args.blocks, args.block_size, args.seed)
    paged = run_paged(make_workload(args.requests, args.seed), args.blocks, args.block_size, args.overcommit, args.seed)
    report(make_workload(args.requests, args.seed), args.blocks, args.block_size, args.overcommit, stock, paged)
    print(f"\n(simulated in {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
