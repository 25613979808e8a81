"""One trace through three KV allocators on the same memory budget (no model, seconds to run).

Allocators (all admit FIFO with head-of-line blocking, as the stock router's queue does):

- ``contiguous``: each request gets one contiguous range of ``prompt + max_new_tokens`` token slots
  at admission, placed first-fit in a single byte range (holes are merged on free), so external
  fragmentation is real. Token granularity, no preemption.
- ``stock``: the stock TGI v3 router and shard: ``ceil((prompt + max_new_tokens - 1) / block_size)``
  blocks out of the physical pool, all backed at admission (worst-case reservation), never preempted.
- ``paged``: this backend. The router reserves the same worst case, but out of a virtual pool of
  ``overcommit x`` physical tokens; the shard backs blocks lazily through the real
  :class:`~tgi_paged_backend.memory.KVCacheManager` (prefix retention on), brakes admission with
  :func:`~tgi_paged_backend.policy.admission.should_brake`, and when the pool runs dry preempts the
  latest admitted request (:func:`~tgi_paged_backend.policy.victims.victim_order`), by swap or
  recompute (:func:`~tgi_paged_backend.policy.preemption_mode.choose_preemption_mode`). Preempted
  requests resume first, oldest first.

One step = one engine forward: every scheduled request computes one token (its prompt, or its whole
history on a recompute resume, on the step it is prefilled). A request whose answer has
``output_tokens`` tokens finishes on the step that produces the last one; its last token's K/V is
never written, as in TGI. Step time comes from a :class:`StepCostModel` (a roofline: weights + KV
read vs FLOPs; the unit model makes every step 1 s, i.e. "steps").

Waste, in slots of the physical pool, time-averaged over the run (the same three kinds the shard
exports as ``tgi_paged_kv_waste_ratio{kind}``):

- **internal**: allocated slots in a request's last, partly written block (token-granular
  contiguous ranges have none);
- **reservation**: allocated slots (whole blocks, or the rest of a contiguous range) that hold no
  token yet: what worst-case reservation holds "just in case". Virtual (router) reservations of
  the paged allocator cost nothing physical and are reported apart;
- **external**: free slots at a step where a request waits for memory (the FIFO head cannot be
  admitted, or an admitted request cannot get blocks): memory that sits idle while work waits.
  ``fragmentation_steps`` counts the steps where the contiguous head did not fit although the free
  total was enough (pure external fragmentation).

"OOM-equivalent failures" are requests whose reservation can never fit the allocator's budget (the
stock router would leave them queued forever; a contiguous server would fail them).

KV layer groups (``SimConfig.groups``, models mixing sliding-window and full-attention layers): the paged
allocator runs the manager with one page map per group over the pool, as the shard does; a pool block
then holds one group's ``layers_per_block`` layers, so the token positions the pool holds when every
group keeps every block are ``usable_blocks // num_groups x block_size`` (:attr:`SimConfig.kv_tokens`,
the shard's ``physical_tokens``). Contiguous and stock get those positions of every layer (when the
grouping pads, e.g. Gemma-3-27B, the same bytes would hold a few more all-layer positions), the router's
virtual pool is ``overcommit x budget_gain x`` them (the shard's advertised budget), and the paged
allocator's block slots count ``1 / num_groups`` of a position each in the waste and occupancy figures
(with windows, positions whose blocks were given back count as held no more).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tgi_paged_backend.config import PreemptionMode
from tgi_paged_backend.memory import KVCacheManager
from tgi_paged_backend.memory.window_reclaim import max_request_blocks
from tgi_paged_backend.planning.workload import TraceRequest
from tgi_paged_backend.policy.admission import should_brake
from tgi_paged_backend.policy.preemption_mode import RateCalibrator, choose_preemption_mode
from tgi_paged_backend.policy.victims import VictimCandidate, victim_order

ALLOCATORS: tuple[str, ...] = ("contiguous", "stock", "paged")
MAX_SERIES_POINTS = 1500


# --------------------------------------------------------------------------------------- config
@dataclass(frozen=True, slots=True, kw_only=True)
class StepCostModel:
    """Seconds of one engine step: ``fixed + max(memory time, compute time) + swap copies``.

    memory time = (weights + KV bytes of every attended token) / bandwidth; compute time = FLOPs of
    every computed token / FLOP rate. :meth:`unit` (the default) makes every step last 1 s. A layer with a
    sliding window reads only its window (``kv_windows``, :meth:`attended_tokens`).
    """

    fixed_s: float = 1.0
    weights_bytes: float = 0.0
    kv_bytes_per_token: float = 0.0
    flops_per_token: float = 0.0
    mem_bytes_per_s: float = 1.0
    flops_per_s: float = 1.0
    swap_bytes_per_s: float = 25e9
    kv_windows: tuple[tuple[int | None, float], ...] = ()
    """Each attention window (``None``: full) with its share of ``kv_bytes_per_token``; ``()``: all full."""

    @classmethod
    def unit(cls) -> StepCostModel:
        return cls()

    def attended_tokens(self, num_positions: int) -> float:
        """Positions a request of ``num_positions`` reads per step, as full-attention equivalents (each
        windowed layer reads at most its window)."""
        if not self.kv_windows:
            return float(num_positions)
        return sum(share * (num_positions if w is None else min(num_positions, w)) for w, share in self.kv_windows)

    @property
    def is_unit(self) -> bool:
        return self.weights_bytes == 0 and self.flops_per_token == 0

    def step_s(self, *, context_tokens: float, computed_tokens: int, swap_bytes: int = 0) -> float:
        memory = (self.weights_bytes + self.kv_bytes_per_token * context_tokens) / self.mem_bytes_per_s
        compute = self.flops_per_token * computed_tokens / self.flops_per_s
        return self.fixed_s + max(memory, compute) + swap_bytes / self.swap_bytes_per_s

    def calibrator(self) -> RateCalibrator:
        """Rates for the swap-vs-recompute choice (policy defaults under the unit model)."""
        if self.is_unit:
            return RateCalibrator()
        return RateCalibrator(
            prefill_tokens_per_s=self.flops_per_s / self.flops_per_token, copy_bytes_per_s=self.swap_bytes_per_s
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """The budget and the knobs, shared by the three allocators."""

    num_blocks: int
    """Physical pool in blocks *including* block 0 (``TGI_PAGED_NUM_BLOCKS``); ``num_blocks - 1``
    are usable, for every allocator (stock TGI never hands out block 0 either)."""
    block_size: int = 16
    overcommit: float = 2.0
    """Paged only: the router's virtual pool is ``overcommit x`` the physical tokens."""
    max_prefill_tokens: int = 4096
    """Prompt tokens the router admits per step (``max_batch_prefill_tokens``); the shard's chunk budget."""
    max_batch_size: int | None = None
    watermark: float = 0.01
    preemption: PreemptionMode = "auto"
    """``auto``, ``recompute`` or ``swap`` (paged only)."""
    num_swap_blocks: int = 0
    """CPU swap blocks (paged only; 0 means recompute only)."""
    block_bytes: int = 0
    """Bytes of one block (swap cost); 0 makes swaps free in time."""
    max_preemptions: int = 8
    prefix_retention: bool = True
    reclaim_window: int | None = None
    """Paged only: the model's window when every layer is windowed (blocks behind it are given back)."""
    groups: tuple[int | None, ...] | None = None
    """Paged only, instead of ``reclaim_window``: each KV layer group's window (``None``: full attention),
    one page map per group over the pool (``KVCacheManager(groups=...)``; :mod:`~tgi_paged_backend.memory.
    layer_groups`). ``num_blocks`` are then blocks of one group's layers (see the module docstring)."""
    budget_gain: float = 1.0
    """Paged only: the router's pool grows by it with layer groups
    (:attr:`~tgi_paged_backend.engine.capacity.Capacity.budget_gain`)."""
    cost: StepCostModel = field(default_factory=StepCostModel.unit)

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_size < 1 or self.overcommit < 1.0 or self.budget_gain < 1.0:
            raise ValueError(f"invalid simulation config {self}")
        if self.groups is not None and (not self.groups or self.reclaim_window is not None):
            raise ValueError(f"groups={self.groups}: at least one group, and not with reclaim_window")
        if self.usable_blocks < self.num_groups:
            raise ValueError(f"num_blocks={self.num_blocks}: fewer usable blocks than the {self.num_groups} groups")

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_groups(self) -> int:
        """KV layer groups (1 without :attr:`groups`)."""
        return 1 if self.groups is None else len(self.groups)

    @property
    def kv_tokens(self) -> int:
        """Usable physical token positions (the same budget for every allocator): with layer groups, those
        the pool holds when every group keeps every block."""
        return self.usable_blocks // self.num_groups * self.block_size

    def request_blocks(self, num_tokens: int) -> int:
        """Pool blocks one request of ``num_tokens`` positions holds at most (prefilled in one chunk):
        every group's, each sliding one about its window."""
        windows = self.groups if self.groups is not None else (self.reclaim_window,)
        return sum(max_request_blocks(num_tokens, self.block_size, w, num_tokens) for w in windows)


# -------------------------------------------------------------------------------------- requests
WAITING, RUNNING, DROPPED, SWAPPED, DONE = "waiting", "running", "dropped", "swapped", "done"


@dataclass(slots=True, eq=False)
class _Req:
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

    def never_fits(self, r: _Req) -> bool:
        raise NotImplementedError

    def braking(self, live: Sequence[_Req]) -> bool:
        return False

    def admit(self, r: _Req) -> bool:
        raise NotImplementedError

    def release(self, r: _Req) -> None:
        raise NotImplementedError

    def free_slots(self) -> int:
        raise NotImplementedError

    def waste(self, live: Sequence[_Req]) -> tuple[int, int]:
        """``(internal, reservation)`` slots now."""
        raise NotImplementedError

    def pool_slots(self) -> int:
        """The usable pool in token slots (what the waste and occupancy shares are of)."""
        return self.cfg.kv_tokens

    def held_slots(self, live: Sequence[_Req]) -> int:
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
    def need(r: _Req) -> int:
        return r.req.prompt_tokens + r.req.max_new_tokens

    def never_fits(self, r: _Req) -> bool:
        return self.need(r) > self.size

    def admit(self, r: _Req) -> bool:
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

    def release(self, r: _Req) -> None:
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

    def pending_fits_total(self, r: _Req) -> bool:
        """Whether the free total would hold ``r`` (then a failed first-fit is fragmentation)."""
        return self.free_slots() >= self.need(r)

    def waste(self, live: Sequence[_Req]) -> tuple[int, int]:
        return 0, self.used - sum(r.resident for r in live)


class StockAllocator(_Allocator):
    """Worst-case block reservation out of the physical pool, all backed at admission."""

    name = "stock"

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg)
        self.free = cfg.kv_tokens // cfg.block_size  # blocks of every layer on the same memory
        self.total = self.free

    def blocks(self, r: _Req) -> int:
        return -(-r.req.reserved_tokens // self.bs)

    def never_fits(self, r: _Req) -> bool:
        return self.blocks(r) > self.total

    def admit(self, r: _Req) -> bool:
        n = self.blocks(r)
        if n > self.free:
            return False
        self.free -= n
        r.virtual, r.reserved_slots = n, n * self.bs
        return True

    def release(self, r: _Req) -> None:
        self.free += r.virtual
        r.virtual = r.reserved_slots = 0

    def free_slots(self) -> int:
        return self.free * self.bs

    def waste(self, live: Sequence[_Req]) -> tuple[int, int]:
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
        """A pool block slot is ``1 / num_groups`` of a position of every layer (module docstring)."""
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

    def blocks(self, r: _Req) -> int:
        return -(-r.req.reserved_tokens // self.bs)

    def never_fits(self, r: _Req) -> bool:
        # A reservation bigger than the router's pool, or a request longer than the physical pool.
        return (
            self.blocks(r) > self.virtual_total or self.cfg.request_blocks(r.req.total_tokens) > self.cfg.usable_blocks
        )

    def braking(self, live: Sequence[_Req]) -> bool:
        waiting = sum(1 for r in live if r.state in (DROPPED, SWAPPED))
        return should_brake(self.kv.num_available_blocks, self.kv.num_total_blocks, self.cfg.watermark, waiting)

    def admit(self, r: _Req) -> bool:
        n = self.blocks(r)
        if n > self.virtual_free:
            return False
        self.virtual_free -= n
        r.virtual = n
        self.kv.add_request(r.idx)
        r.history = _prompt_ids(r)
        return True

    def _commit(self, r: _Req) -> None:
        """Record the written history before the manager registers it for retention (free or
        preemption). The engine commits every step; only these moments read it."""
        if r.resident > r.committed:
            self.kv.commit_tokens(r.idx, r.history[: r.resident])
            r.committed = r.resident

    def release(self, r: _Req) -> None:
        self._commit(r)
        self.kv.free(r.idx)
        self.virtual_free += r.virtual
        r.virtual = r.resident = r.backed = 0

    def free_slots(self) -> int:
        return self.kv.num_available_blocks * self.bs // self.num_groups

    def waste(self, live: Sequence[_Req]) -> tuple[int, int]:
        # Every group holds (or has given back: holes) a block slot per written position.
        windowed = self.cfg.reclaim_window is not None or any(w is not None for w in self.cfg.groups or ())
        self.hole_blocks = self.kv.stats().num_hole_blocks if windowed else 0
        internal = (self.kv.num_used_blocks + self.hole_blocks) * self.bs - self.num_groups * sum(
            r.resident for r in live
        )
        return max(internal, 0) // self.num_groups, 0

    def pool_slots(self) -> int:
        return self.cfg.usable_blocks * self.bs // self.num_groups

    def held_slots(self, live: Sequence[_Req]) -> int:
        # Written positions less those whose blocks a window gave back (holes), in every group.
        held = self.num_groups * sum(r.resident for r in live) - self.hole_blocks * self.bs
        return max(held, 0) // self.num_groups

    def virtual_unbacked_slots(self, live: Sequence[_Req]) -> int:
        return max(sum(r.virtual for r in live) * self.bs - self.kv.num_used_blocks * self.bs // self.num_groups, 0)

    # -- backing and preemption --------------------------------------------------------------
    def back(self, r: _Req, live: Sequence[_Req], preempted_now: set[int]) -> int | None:
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

    def priority(self, r: _Req) -> tuple[int, int]:
        """The engine scheduler's order: protected requests (preempted ``max_preemptions`` times)
        first, then admission order."""
        return (0 if r.num_preemptions >= self.cfg.max_preemptions else 1, r.seq)

    def _victim(self, r: _Req, live: Sequence[_Req], preempted_now: set[int]) -> _Req | None:
        """One running request after ``r`` in priority order that holds blocks, as the engine's
        scheduler picks it: the policy's order (latest admitted first, protected ones left out), or
        the latest protected one when nothing else is left.

        ``live`` is in priority order, so walking it backwards meets the policy's first choice
        first; candidates are collected up to there only (the same answer, without sizing every
        request's memory each time).
        """
        rank = self.priority(r)
        holders: dict[int, _Req] = {}
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

    def preempt(self, v: _Req) -> None:
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

    def swap_in(self, r: _Req, live: Sequence[_Req], preempted_now: set[int]) -> bool:
        while (plan := self.kv.swap_in(r.idx)) is None:
            victim = self._victim(r, live, preempted_now)
            if victim is None:
                return False
            self.preempt(victim)
            preempted_now.add(victim.idx)
        self.step_swap_bytes += plan.num_blocks * self.cfg.block_bytes
        r.state, r.resident = RUNNING, r.written
        return True


def _prompt_ids(r: _Req) -> list[int]:
    # Unique first token per request: no accidental prefix sharing between requests.
    return [1_000_000 + r.idx] + [(r.idx * 31 + k) % 50_000 for k in range(1, r.req.prompt_tokens)]


def make_allocator(kind: str, cfg: SimConfig) -> _Allocator:
    try:
        cls = {"contiguous": ContiguousAllocator, "stock": StockAllocator, "paged": PagedAllocator}[kind]
    except KeyError:
        raise ValueError(f"allocator {kind!r} is invalid: allowed {ALLOCATORS}") from None
    return cls(cfg)


# --------------------------------------------------------------------------------------- results
@dataclass(slots=True)
class SimResult:
    """What one allocator did with one trace."""

    allocator: str
    overcommit: float
    num_requests: int
    finished: int
    failed: int
    """OOM-equivalent: reservation can never fit the budget."""
    steps: int
    sim_time_s: float
    generated_tokens: int
    tokens_per_s: float
    requests_per_s: float
    mean_running: float
    """Time-averaged requests computing per step (the batch size)."""
    peak_running: int
    mean_admitted: float
    """Time-averaged requests admitted and not finished (running + preempted/waiting)."""
    peak_admitted: int
    mean_queued: float
    peak_queued: int
    waste_internal: float
    """Fractions of the usable physical pool, time-averaged."""
    waste_reservation: float
    waste_external: float
    kv_used: float
    """Fraction of the pool holding written K/V, time-averaged."""
    virtual_unbacked: float
    """Paged only: router-reserved slots with no physical block, as a fraction of the pool."""
    fragmentation_steps: int
    admit_refusals: int
    """Steps where the FIFO head did not fit the allocator (paged: the router's virtual pool)."""
    preemptions_recompute: int
    preemptions_swap: int
    recomputed_tokens: int
    computed_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    latency_mean_s: float
    series: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @property
    def waste_total(self) -> float:
        return self.waste_internal + self.waste_reservation + self.waste_external

    @property
    def preemptions(self) -> int:
        return self.preemptions_recompute + self.preemptions_swap

    @property
    def recompute_tax(self) -> float:
        """Recomputed tokens over all computed tokens."""
        return self.recomputed_tokens / self.computed_tokens if self.computed_tokens else 0.0

    def to_dict(self, *, series: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not series:
            out.pop("series")
        out.update(waste_total=self.waste_total, preemptions=self.preemptions, recompute_tax=self.recompute_tax)
        return out


class _Accum:
    """Time-weighted sums and a thinned series."""

    def __init__(self) -> None:
        self.total_t = 0.0
        self.sums: dict[str, float] = {}
        self.series: dict[str, list[float]] = {k: [] for k in ("t", "running", "admitted", "queued", "used", "waste")}

    def add(self, dt: float, **values: float) -> None:
        self.total_t += dt
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + v * dt

    def mean(self, key: str) -> float:
        return self.sums.get(key, 0.0) / self.total_t if self.total_t else 0.0

    def point(self, **values: float) -> None:
        for k, v in values.items():
            self.series[k].append(float(v))

    def thinned(self) -> dict[str, list[float]]:
        n = len(self.series["t"])
        if n <= MAX_SERIES_POINTS:
            return self.series
        keep = np.linspace(0, n - 1, MAX_SERIES_POINTS).astype(int)
        return {k: [v[i] for i in keep] for k, v in self.series.items()}


# ------------------------------------------------------------------------------------ simulation
def simulate(trace: Sequence[TraceRequest], allocator: str, cfg: SimConfig) -> SimResult:
    """Run ``trace`` through one allocator; see the module docstring for the model."""
    alloc = make_allocator(allocator, cfg)
    paged = alloc if isinstance(alloc, PagedAllocator) else None
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival)
    reqs = [_Req(i, trace[i]) for i in order]
    pool = alloc.pool_slots()
    queue: deque[_Req] = deque()
    live: list[_Req] = []  # admitted, in admission order
    clock, nxt, seq, steps = 0.0, 0, 0, 0
    failed = finished = peak_running = peak_admitted = peak_queued = 0
    frag_steps = computed_total = recomputed_total = generated_total = admit_refusals = 0
    acc = _Accum()

    while nxt < len(reqs) or queue or live:
        if not queue and not live and reqs[nxt].req.arrival > clock:
            clock = reqs[nxt].req.arrival  # idle until the next arrival
        while nxt < len(reqs) and reqs[nxt].req.arrival <= clock:
            queue.append(reqs[nxt])
            nxt += 1

        # 1. The router admits FIFO; the first request that does not fit blocks the queue.
        memory_blocked = False
        pending: _Req | None = None
        admitted_prompt = 0
        while queue:
            r = queue[0]
            if alloc.never_fits(r):
                queue.popleft()
                r.state = DONE
                failed += 1
                continue
            if cfg.max_batch_size is not None and len(live) >= cfg.max_batch_size:
                break
            if admitted_prompt and admitted_prompt + r.req.prompt_tokens > cfg.max_prefill_tokens:
                break
            if alloc.braking(live):
                memory_blocked, pending = True, r
                break
            if not alloc.admit(r):
                memory_blocked, pending = True, r
                admit_refusals += 1
                break
            queue.popleft()
            r.seq, seq = seq, seq + 1
            r.state = WAITING
            live.append(r)
            admitted_prompt += r.req.prompt_tokens

        # 2. One engine step over the admitted requests, oldest first.
        if paged is not None:
            paged.step_swap_bytes = 0
        preempted_now: set[int] = set()
        prefill_left = cfg.max_prefill_tokens
        computed = recomputed = 0
        context = 0.0  # positions the step's attention reads (cost.attended_tokens)
        produced: list[_Req] = []
        if paged is not None and any(r.num_preemptions >= cfg.max_preemptions for r in live):
            live.sort(key=paged.priority)
        for r in live:
            if r.idx in preempted_now:
                continue
            if paged is None:
                if r.state == WAITING:  # backed at admission
                    r.history = [0] * r.req.prompt_tokens
                    computed += r.req.prompt_tokens
                else:
                    computed += 1
                context += cfg.cost.attended_tokens(len(r.history))
                r.state, r.resident = RUNNING, len(r.history)
                produced.append(r)
                continue
            if r.state == SWAPPED and not paged.swap_in(r, live, preempted_now):
                memory_blocked = True
                continue
            if r.state in (WAITING, DROPPED):
                if prefill_left <= 0:
                    continue  # the step's token budget is spent: prefill next step
                hit = paged.back(r, live, preempted_now)
                if hit is None:
                    memory_blocked = True
                    continue
                work = len(r.history) - hit
                prefill_left -= work
                if r.state == DROPPED:
                    recomputed += max(work - 1, 0)  # all but the newest position was computed before
                computed += work
            else:
                if paged.back(r, live, preempted_now) is None:
                    memory_blocked = True  # waits this step, keeps its blocks
                    continue
                computed += 1
            context += cfg.cost.attended_tokens(len(r.history))
            r.state, r.resident = RUNNING, len(r.history)
            produced.append(r)
        running = len(produced)

        swap_bytes = paged.step_swap_bytes if paged is not None else 0
        dt = cfg.cost.step_s(context_tokens=context, computed_tokens=computed, swap_bytes=swap_bytes)
        clock += dt
        steps += 1
        computed_total += computed
        recomputed_total += recomputed

        # 3. Tokens out; finished requests release everything at once.
        done: list[_Req] = []
        for r in produced:
            r.generated += 1
            generated_total += 1
            if r.generated == 1:
                r.t_first = clock
            if r.generated >= r.req.output_tokens:
                r.state, r.t_done = DONE, clock
                done.append(r)
            else:
                r.history.append((r.idx * 7 + r.generated) % 50_000)
        # 4. Sample occupancy and waste (before releasing: this is what the step held).
        internal, reservation = alloc.waste(live)
        free = alloc.free_slots()
        external = free if memory_blocked else 0
        if memory_blocked and pending is not None and isinstance(alloc, ContiguousAllocator):
            frag_steps += alloc.pending_fits_total(pending)
        written = alloc.held_slots(live)
        virtual = paged.virtual_unbacked_slots(live) if paged is not None else 0
        acc.add(
            dt,
            running=running,
            admitted=len(live),
            queued=len(queue),
            internal=internal,
            reservation=reservation,
            external=external,
            used=written,
            virtual=virtual,
        )
        acc.point(
            t=clock,
            running=running,
            admitted=len(live),
            queued=len(queue),
            used=written / pool,
            waste=(internal + reservation + external) / pool,
        )
        peak_running = max(peak_running, running)
        peak_admitted = max(peak_admitted, len(live))
        peak_queued = max(peak_queued, len(queue))
        for r in done:
            alloc.release(r)
            finished += 1
        if done:
            gone = {id(r) for r in done}
            live = [r for r in live if id(r) not in gone]
        if paged is None and not produced and live:
            raise RuntimeError(f"{allocator}: no progress with {len(live)} admitted requests")

    ok = [r for r in reqs if not math.isnan(r.t_done)]
    ttft = np.array([r.t_first - r.req.arrival for r in ok]) if ok else np.zeros(1)
    latency = np.array([r.t_done - r.req.arrival for r in ok]) if ok else np.zeros(1)
    span = clock - (reqs[0].req.arrival if reqs else 0.0)
    useful = sum(r.req.output_tokens for r in ok)
    preemptions = paged.preemptions if paged is not None else {"recompute": 0, "swap": 0}
    if paged is not None:
        paged.kv.check_invariants()
    return SimResult(
        allocator=allocator,
        overcommit=cfg.overcommit if paged is not None else 1.0,
        num_requests=len(reqs),
        finished=finished,
        failed=failed,
        steps=steps,
        sim_time_s=clock,
        generated_tokens=useful,
        tokens_per_s=useful / span if span > 0 else 0.0,
        requests_per_s=len(ok) / span if span > 0 else 0.0,
        mean_running=acc.mean("running"),
        peak_running=peak_running,
        mean_admitted=acc.mean("admitted"),
        peak_admitted=peak_admitted,
        mean_queued=acc.mean("queued"),
        peak_queued=peak_queued,
        waste_internal=acc.mean("internal") / pool,
        waste_reservation=acc.mean("reservation") / pool,
        waste_external=acc.mean("external") / pool,
        kv_used=acc.mean("used") / pool,
        virtual_unbacked=acc.mean("virtual") / pool,
        fragmentation_steps=frag_steps,
        admit_refusals=admit_refusals,
        preemptions_recompute=preemptions["recompute"],
        preemptions_swap=preemptions["swap"],
        recomputed_tokens=recomputed_total,
        computed_tokens=computed_total,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        latency_mean_s=float(latency.mean()),
        series=acc.thinned(),
    )


@dataclass(slots=True)
class Comparison:
    """Contiguous, stock and paged (at each overcommit) on one trace and budget."""

    contiguous: SimResult
    stock: SimResult
    paged: dict[float, SimResult]
    chosen_overcommit: float

    @property
    def best(self) -> SimResult:
        return self.paged[self.chosen_overcommit]

    def to_dict(self, *, series: bool = False) -> dict[str, Any]:
        return {
            "contiguous": self.contiguous.to_dict(series=series),
            "stock": self.stock.to_dict(series=series),
            "paged": {str(k): v.to_dict(series=series) for k, v in self.paged.items()},
            "chosen_overcommit": self.chosen_overcommit,
        }


DEFAULT_OVERCOMMITS: tuple[float, ...] = (1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
MAX_RECOMPUTE_TAX = 0.10
THROUGHPUT_TOLERANCE = 0.03
WASTE_TOLERANCE = 0.01


def advise_overcommit(
    paged: dict[float, SimResult],
    *,
    max_recompute_tax: float = MAX_RECOMPUTE_TAX,
    tolerance: float = THROUGHPUT_TOLERANCE,
    waste_tolerance: float = WASTE_TOLERANCE,
) -> float:
    """The smallest overcommit that gives up nothing that matters.

    Among the runs with no failure and a recompute tax of at most ``max_recompute_tax`` (all runs if
    none qualifies): the smallest overcommit whose throughput is within ``tolerance`` of the best and
    whose KV waste is within ``waste_tolerance`` (absolute) of the lowest; when none is within both,
    the fastest of those within the waste tolerance. A smaller overcommit means fewer preemptions and
    less exposure to long answers; a larger one buys nothing here.
    """
    ok = {k: v for k, v in paged.items() if v.recompute_tax <= max_recompute_tax and v.failed == 0} or paged
    return pick_overcommit(
        {k: (v.tokens_per_s, v.waste_total) for k, v in ok.items()},
        tolerance=tolerance,
        waste_tolerance=waste_tolerance,
    )


def pick_overcommit(runs: dict[float, tuple[float, float]], *, tolerance: float, waste_tolerance: float) -> float:
    """The overcommit rule on ``{overcommit: (tokens/s, waste share)}`` of the eligible runs (shared by
    the simulation's advice and the end-to-end bench's recommendation): the smallest overcommit within
    ``tolerance`` of the best tokens/s and ``waste_tolerance`` (absolute) of the lowest waste; when none
    is within both, the fastest of those within the waste tolerance."""
    best = max(tps for tps, _ in runs.values())
    least_waste = min(waste for _, waste in runs.values())
    lean = {k: tps for k, (tps, waste) in runs.items() if waste <= least_waste + waste_tolerance}
    good = [k for k, tps in lean.items() if tps >= (1 - tolerance) * best]
    return min(good) if good else max(lean, key=lean.__getitem__)


def compare(
    trace: Sequence[TraceRequest], cfg: SimConfig, overcommits: Sequence[float] = DEFAULT_OVERCOMMITS
) -> Comparison:
    """All three allocators on ``trace``; paged once per overcommit, the advised one marked."""
    from dataclasses import replace

    contiguous = simulate(trace, "contiguous", cfg)
    stock = simulate(trace, "stock", cfg)
    paged: dict[float, SimResult] = {}
    previous: SimResult | None = None
    for oc in sorted(float(x) for x in overcommits):
        if previous is not None and previous.admit_refusals == 0:
            # The router's pool never refused anyone: a bigger pool changes nothing (deterministic).
            paged[oc] = replace(previous, overcommit=oc)
        else:
            paged[oc] = previous = simulate(trace, "paged", replace(cfg, overcommit=oc))
    return Comparison(contiguous, stock, paged, advise_overcommit(paged))
