"""The three KV allocators the simulation compares (contiguous, stock TGI, paged) and the per-request
state they share; :mod:`~tgi_paged_backend.planning.allocator_sim` describes the model and runs a trace
through them."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tgi_paged_backend.memory import KVCacheManager
from tgi_paged_backend.planning.sim_config import SimConfig
from tgi_paged_backend.planning.workload import TraceRequest
from tgi_paged_backend.policy.admission import should_brake
from tgi_paged_backend.policy.preemption_mode import choose_preemption_mode
from tgi_paged_backend.policy.victims import VictimCandidate, victim_order

ALLOCATORS: tuple[str, ...] = ("contiguous", "stock", "paged")


# -------------------------------------------------------------------------------------- requests
WAITING, RUNNING, DROPPED, SWAPPED, DONE = "waiting", "running", "dropped", "swapped", "done"


@dataclass(slots=True, eq=False)
class SimRequest:
    """One trace request as the simulation steps it (what every allocator reads and updates)."""

    idx: int
    req: TraceRequest
    seq: int = -1
    state: str = WAITING
    """waiting (admitted, needs its prefill), running, dropped (recompute-preempted), swapped, done."""
    generated: int = 0
    history: list[int] = field(default_factory=list)
    resident: int = 0
    """Positions whose K/V is written and held in device memory."""
    reserved_slots: int = 0
    """Physical slots held for the request (contiguous / stock)."""
    start: int = -1
    """Contiguous range start."""
    virtual: int = 0
    """Router blocks reserved (stock / paged)."""
    needs_match: bool = True
    committed: int = 0
    """Positions last recorded with ``commit_tokens`` (paged: committed lazily, before a release)."""
    backed: int = 0
    """Positions the paged manager backs already (0: ask it)."""
    num_preemptions: int = 0
    t_first: float = math.nan
    t_done: float = math.nan

    @property
    def written(self) -> int:
        """Positions with K/V computed: the history minus its last (not yet computed) token."""
        return max(len(self.history) - 1, 0) if self.generated else 0


# ------------------------------------------------------------------------------------ allocators
class _Allocator:
    name = ""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.bs = cfg.block_size

    def never_fits(self, r: SimRequest) -> bool:
        raise NotImplementedError

    def braking(self, live: Sequence[SimRequest]) -> bool:
        return False

    def admit(self, r: SimRequest) -> bool:
        raise NotImplementedError

    def release(self, r: SimRequest) -> None:
        raise NotImplementedError

    def free_slots(self) -> int:
        raise NotImplementedError

    def waste(self, live: Sequence[SimRequest]) -> tuple[int, int]:
        """``(internal, reservation)`` slots now."""
        raise NotImplementedError

    def pool_slots(self) -> int:
        """The usable pool in token slots (what the waste and occupancy shares are of)."""
        return self.cfg.kv_tokens

    def held_slots(self, live: Sequence[SimRequest]) -> int:
        """Slots holding written K/V now (after :meth:`waste`, which samples the step)."""
        return sum(r.resident for r in live)


class ContiguousAllocator(_Allocator):
    """First-fit contiguous ranges of ``prompt + max_new_tokens`` slots in one byte range."""

    name = "contiguous"

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg)
        self.size = cfg.kv_tokens
        self.holes: list[tuple[int, int]] = [(0, self.size)]  # (start, length), sorted by start
        self.used = 0

    @staticmethod
    def need(r: SimRequest) -> int:
        return r.req.prompt_tokens + r.req.max_new_tokens

    def never_fits(self, r: SimRequest) -> bool:
        return self.need(r) > self.size

    def admit(self, r: SimRequest) -> bool:
        need = self.need(r)
        for i, (start, length) in enumerate(self.holes):
            if length >= need:
                if length == need:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + need, length - need)
                r.start, r.reserved_slots = start, need
                self.used += need
                return True
        return False

    def release(self, r: SimRequest) -> None:
        start, length = r.start, r.reserved_slots
        i = bisect.bisect_left(self.holes, (start, 0))
        # Merge with the previous and next holes when adjacent.
        if i > 0 and sum(self.holes[i - 1]) == start:
            i -= 1
            start, length = self.holes[i][0], self.holes[i][1] + length
            del self.holes[i]
        if i < len(self.holes) and start + length == self.holes[i][0]:
            length += self.holes[i][1]
            del self.holes[i]
        self.holes.insert(i, (start, length))
        self.used -= r.reserved_slots
        r.reserved_slots = 0

    def free_slots(self) -> int:
        return self.size - self.used

    def pending_fits_total(self, r: SimRequest) -> bool:
        """Whether the free total would hold ``r`` (then a failed first-fit is fragmentation)."""
        return self.free_slots() >= self.need(r)

    def waste(self, live: Sequence[SimRequest]) -> tuple[int, int]:
        return 0, self.used - sum(r.resident for r in live)


class StockAllocator(_Allocator):
    """Worst-case block reservation out of the physical pool, all backed at admission."""

    name = "stock"

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg)
        self.free = cfg.kv_tokens // cfg.block_size  # blocks of every layer on the same memory
        self.total = self.free

    def blocks(self, r: SimRequest) -> int:
        return -(-r.req.reserved_tokens // self.bs)

    def never_fits(self, r: SimRequest) -> bool:
        return self.blocks(r) > self.total

    def admit(self, r: SimRequest) -> bool:
        n = self.blocks(r)
        if n > self.free:
            return False
        self.free -= n
        r.virtual, r.reserved_slots = n, n * self.bs
        return True

    def release(self, r: SimRequest) -> None:
        self.free += r.virtual
        r.virtual = r.reserved_slots = 0

    def free_slots(self) -> int:
        return self.free * self.bs

    def waste(self, live: Sequence[SimRequest]) -> tuple[int, int]:
        internal = reservation = 0
        for r in live:
            written_blocks = -(-r.resident // self.bs)
            internal += written_blocks * self.bs - r.resident
            reservation += (r.virtual - written_blocks) * self.bs
        return internal, reservation


class PagedAllocator(_Allocator):
    """Overcommitted router blocks over lazily backed physical blocks (the real memory manager)."""

    name = "paged"

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg)
        self.kv = KVCacheManager(
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            num_swap_blocks=cfg.num_swap_blocks if cfg.preemption != "recompute" else 0,
            enable_prefix_retention=cfg.prefix_retention,
            reclaim_window=cfg.reclaim_window,
            groups=cfg.groups,
        )
        self.num_groups = cfg.num_groups
        """A pool block slot is ``1 / num_groups`` of a position of every layer (see
        :mod:`~tgi_paged_backend.planning.allocator_sim`)."""
        self.hole_blocks = 0
        """Hole blocks (given back behind a window) at the last :meth:`waste` sample."""
        # The router's pool: floor(advertised / block_size) blocks, block 0 never handed out.
        advertised = int(cfg.kv_tokens * cfg.budget_gain * cfg.overcommit) // cfg.block_size * cfg.block_size
        self.virtual_free = advertised // cfg.block_size - 1
        self.virtual_total = self.virtual_free
        self.calibrator = cfg.cost.calibrator()
        self.preemptions = {"recompute": 0, "swap": 0}
        self.recomputed_tokens = 0
        self.swap_bytes = 0
        self.step_swap_bytes = 0

    def blocks(self, r: SimRequest) -> int:
        return -(-r.req.reserved_tokens // self.bs)

    def never_fits(self, r: SimRequest) -> bool:
        # A reservation bigger than the router's pool, or a request longer than the physical pool.
        return (
            self.blocks(r) > self.virtual_total or self.cfg.request_blocks(r.req.total_tokens) > self.cfg.usable_blocks
        )

    def braking(self, live: Sequence[SimRequest]) -> bool:
        waiting = sum(1 for r in live if r.state in (DROPPED, SWAPPED))
        return should_brake(self.kv.num_available_blocks, self.kv.num_total_blocks, self.cfg.watermark, waiting)

    def admit(self, r: SimRequest) -> bool:
        n = self.blocks(r)
        if n > self.virtual_free:
            return False
        self.virtual_free -= n
        r.virtual = n
        self.kv.add_request(r.idx)
        r.history = _prompt_ids(r)
        return True

    def _commit(self, r: SimRequest) -> None:
        """Record the written history before the manager registers it for retention (free or
        preemption). The engine commits every step; only these moments read it."""
        if r.resident > r.committed:
            self.kv.commit_tokens(r.idx, r.history[: r.resident])
            r.committed = r.resident

    def release(self, r: SimRequest) -> None:
        self._commit(r)
        self.kv.free(r.idx)
        self.virtual_free += r.virtual
        r.virtual = r.resident = r.backed = 0

    def free_slots(self) -> int:
        return self.kv.num_available_blocks * self.bs // self.num_groups

    def waste(self, live: Sequence[SimRequest]) -> tuple[int, int]:
        # Every group holds (or has given back: holes) a block slot per written position.
        windowed = self.cfg.reclaim_window is not None or any(w is not None for w in self.cfg.groups or ())
        self.hole_blocks = self.kv.stats().num_hole_blocks if windowed else 0
        internal = (self.kv.num_used_blocks + self.hole_blocks) * self.bs - self.num_groups * sum(
            r.resident for r in live
        )
        return max(internal, 0) // self.num_groups, 0

    def pool_slots(self) -> int:
        return self.cfg.usable_blocks * self.bs // self.num_groups

    def held_slots(self, live: Sequence[SimRequest]) -> int:
        # Written positions less those whose blocks a window gave back (holes), in every group.
        held = self.num_groups * sum(r.resident for r in live) - self.hole_blocks * self.bs
        return max(held, 0) // self.num_groups

    def virtual_unbacked_slots(self, live: Sequence[SimRequest]) -> int:
        return max(sum(r.virtual for r in live) * self.bs - self.kv.num_used_blocks * self.bs // self.num_groups, 0)

    # -- backing and preemption --------------------------------------------------------------
    def back(self, r: SimRequest, live: Sequence[SimRequest], preempted_now: set[int]) -> int | None:
        """Back positions ``[0, len(history))``; returns prefix-hit tokens, or ``None`` to wait.

        Later-admitted running requests are preempted while the pool is short.
        """
        kv = self.kv
        hit = 0
        if r.needs_match:
            hit = kv.match_prefix(r.idx, r.history).num_cached_tokens
            r.needs_match = False
            r.resident = r.committed = hit
        elif len(r.history) <= r.backed:
            return 0
        while kv.allocate(r.idx, len(r.history)) is None:
            victim = self._victim(r, live, preempted_now)
            if victim is None:
                return None
            self.preempt(victim)
            preempted_now.add(victim.idx)
        r.backed = -(-len(r.history) // self.bs) * self.bs
        return hit

    def priority(self, r: SimRequest) -> tuple[int, int]:
        """The engine scheduler's order: protected requests (preempted ``max_preemptions`` times)
        first, then admission order."""
        return (0 if r.num_preemptions >= self.cfg.max_preemptions else 1, r.seq)

    def _victim(self, r: SimRequest, live: Sequence[SimRequest], preempted_now: set[int]) -> SimRequest | None:
        """One running request after ``r`` in priority order that holds blocks, as the engine's
        scheduler picks it: the policy's order (latest admitted first, protected ones left out), or
        the latest protected one when nothing else is left.

        ``live`` is in priority order, so walking it backwards meets the policy's first choice
        first; candidates are collected up to there only (the same answer, without sizing every
        request's memory each time).
        """
        rank = self.priority(r)
        holders: dict[int, SimRequest] = {}
        candidates = []
        for v in reversed(live):
            if v.state != RUNNING or v.idx in preempted_now or v.resident == 0:
                continue
            if self.priority(v) <= rank:
                break
            holders[v.idx] = v
            memory = self.kv.request_memory(v.idx)
            candidates.append(VictimCandidate(v.idx, v.seq, v.num_preemptions, memory.num_exclusive_blocks))
            if v.num_preemptions < self.cfg.max_preemptions:
                break
        if not holders:
            return None
        order = victim_order(candidates, max_preemptions=self.cfg.max_preemptions)
        return holders[order[0].request_id] if order else max(holders.values(), key=self.priority)

    def preempt(self, v: SimRequest) -> None:
        kv = self.kv
        self._commit(v)
        memory = kv.request_memory(v.idx)
        decision = choose_preemption_mode(
            self.cfg.preemption,
            num_tokens_to_reprefill=len(v.history),
            num_swap_bytes=memory.num_blocks * self.cfg.block_bytes,
            swap_has_room=kv.can_swap_out(v.idx),
            calibrator=self.calibrator,
        )
        plan = kv.swap_out(v.idx) if decision.mode == "swap" else None
        if plan is not None:
            v.state = SWAPPED
            self.preemptions["swap"] += 1
            self.step_swap_bytes += plan.num_blocks * self.cfg.block_bytes
        else:
            kv.preempt_recompute(v.idx)
            v.state, v.needs_match, v.committed = DROPPED, True, 0
            self.preemptions["recompute"] += 1
        v.resident = v.backed = 0
        v.num_preemptions += 1

    def swap_in(self, r: SimRequest, live: Sequence[SimRequest], preempted_now: set[int]) -> bool:
        while (plan := self.kv.swap_in(r.idx)) is None:
            victim = self._victim(r, live, preempted_now)
            if victim is None:
                return False
            self.preempt(victim)
            preempted_now.add(victim.idx)
        self.step_swap_bytes += plan.num_blocks * self.cfg.block_bytes
        r.state, r.resident = RUNNING, r.written
        return True


def _prompt_ids(r: SimRequest) -> list[int]:
    # Unique first token per request: no accidental prefix sharing between requests.
    return [1_000_000 + r.idx] + [(r.idx * 31 + k) % 50_000 for k in range(1, r.req.prompt_tokens)]


def make_allocator(kind: str, cfg: SimConfig) -> _Allocator:
    try:
        cls = {"contiguous": ContiguousAllocator, "stock": StockAllocator, "paged": PagedAllocator}[kind]
    except KeyError:
        raise ValueError(f"allocator {kind!r} is invalid: allowed {ALLOCATORS}") from None
    return cls(cfg)
