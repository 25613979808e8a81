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

The pieces: :mod:`~tgi_paged_backend.planning.sim_config` (the budget, the knobs, the step time),
:mod:`~tgi_paged_backend.planning.sim_allocators` (the three allocators and the request state),
:mod:`~tgi_paged_backend.planning.sim_results` (the results, the comparison, the overcommit advice); this
module runs a trace through them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from tgi_paged_backend.planning.sim_allocators import (
    DONE,
    DROPPED,
    RUNNING,
    SWAPPED,
    WAITING,
    ContiguousAllocator,
    PagedAllocator,
    SimRequest,
    make_allocator,
)
from tgi_paged_backend.planning.sim_config import SimConfig
from tgi_paged_backend.planning.sim_results import DEFAULT_OVERCOMMITS, Comparison, SimResult, advise_overcommit
from tgi_paged_backend.planning.workload import TraceRequest

MAX_SERIES_POINTS = 1500


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
    reqs = [SimRequest(i, trace[i]) for i in order]
    pool = alloc.pool_slots()
    queue: deque[SimRequest] = deque()
    live: list[SimRequest] = []  # admitted, in admission order
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
        pending: SimRequest | None = None
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
        produced: list[SimRequest] = []
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
        done: list[SimRequest] = []
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
