"""Random lifecycles against KVCacheManager, checked after every step (Hypothesis state machine).

Modelled on TGI's ``invariants_hold_on_many_insertions``: a 2-token vocabulary forces prefix
sharing. Requests are admitted (router-managed or self-managed), decode, finish, get filtered or
cleared, preempted (swap or recompute) and resumed. After every step the manager's invariants must
hold and every running request must read back exactly its own history through the slot mapping
(``memory_sim.KVSim`` executes the copy plans in issue order). When all requests have ended the pool
must be free or retained, and fully free once retained blocks are evicted.

The windowed machines run the same lifecycles with sliding-window reclaim: every running request
reads back exactly the positions its latest query's window covers, holds no more blocks than its
last step reads, and the pool books stay exact (no block leaked, holes never hold one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from memory_sim import KVSim

from tgi_paged_backend.memory import KVCacheManager
from tgi_paged_backend.memory.prefix_tiers import TierSetup
from tgi_paged_backend.memory.window_reclaim import first_visible_position, max_resident_blocks

VOCAB = (0, 1)
U64_MAX = 2**64 - 1


@dataclass
class Req:
    history: list[int]
    max_len: int
    virtual: tuple[int, ...]
    state: str = "dropped"  # running | waiting (matched, allocation pending) | swapped | dropped
    num_cached: int = 0
    num_written: int = 0
    last_step: int = 0
    """Tokens the latest allocation covered (for the resident-block bound of a windowed manager)."""


class MemoryMachine(RuleBasedStateMachine):
    # Pool geometry; subclasses below rerun the machine at other block sizes.
    BS = 4
    NUM_BLOCKS = 13
    NUM_SWAP_BLOCKS = 6
    NUM_VIRTUAL_BLOCKS = 48
    WINDOW: int | None = None
    """Sliding-window reclaim of the manager (``None``: off)."""
    GROUPS: tuple[int | None, ...] | None = None
    """Layer groups' windows instead (one page map per group, :mod:`.kv_group`)."""
    HOST_ROWS = 0
    """Rows of a host tier below the pool (0: none, :mod:`.prefix_tiers`)."""

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(
            num_blocks=self.NUM_BLOCKS,
            block_size=self.BS,
            num_swap_blocks=self.NUM_SWAP_BLOCKS,
            **({"groups": self.GROUPS} if self.GROUPS is not None else {"reclaim_window": self.WINDOW}),
            tiers=TierSetup(self.HOST_ROWS, b"machine") if self.HOST_ROWS else None,
        )
        self.sim = KVSim(self.NUM_BLOCKS, self.BS, self.NUM_SWAP_BLOCKS, self.HOST_ROWS)
        self.reqs: dict[int, Req] = {}
        self.next_id = 0
        self.virtual_free = list(range(self.NUM_VIRTUAL_BLOCKS - 1, 0, -1))  # the router's pool

    # ------------------------------------------------------------------------------- helpers
    def _visible_from(self, first_query: int) -> int:
        """First position a query at ``first_query`` reads (0 without a window)."""
        return 0 if self.WINDOW is None else first_visible_position(first_query, self.WINDOW)

    def _ids(self, *states: str) -> list[int]:
        return sorted(rid for rid, r in self.reqs.items() if r.state in states)

    def _start(self, rid: int) -> None:
        req = self.reqs[rid]
        loads = self.sim.tier_moves["load"]
        match = self.m.match_prefix(rid, req.history)
        self.sim.apply_tier_moves(self.m)
        if self.sim.tier_moves["load"] > loads:
            event("prefix loaded from the host tier")
        assert 0 <= match.num_cached_tokens < len(req.history)
        if match.num_shared_blocks:
            event("prefix blocks shared")
        if match.copy_src is not None:
            event("copy-on-write")
        req.state, req.num_cached, req.num_written = "waiting", match.num_cached_tokens, 0
        self._try_prefill(rid)

    def _try_prefill(self, rid: int) -> None:
        req = self.reqs[rid]
        allocation = self.m.allocate(rid, len(req.history))
        self.sim.apply_tier_moves(self.m)
        if allocation is None:
            event("prefill allocation refused")
            return
        self.sim.apply_allocation(allocation)
        # Whatever the cache supplied (shared or copied) is exactly this request's prefix.
        self.sim.assert_holds(self.m, rid, req.history, req.num_cached, start=self._visible_from(req.num_cached))
        self.sim.write(self.m, rid, req.history, req.num_cached, len(req.history))
        self.m.commit_tokens(rid, req.history)
        req.state, req.num_written = "running", len(req.history)
        req.last_step = len(req.history) - req.num_cached

    def _finish(self, rid: int) -> None:
        self.m.free(rid)
        self.virtual_free.extend(self.reqs.pop(rid).virtual)

    # --------------------------------------------------------------------------------- rules
    @rule(
        prompt=st.lists(st.sampled_from(VOCAB), min_size=1, max_size=14),
        max_new=st.integers(1, 20),
        router=st.booleans(),
        huge_id=st.booleans(),
    )
    def admit(self, prompt: list[int], max_new: int, router: bool, huge_id: bool) -> None:
        rid = U64_MAX - 1 - self.next_id if huge_id else self.next_id
        self.next_id += 1
        max_len = len(prompt) + max_new
        virtual: tuple[int, ...] = ()
        if router:
            num = -(-max_len // self.BS)
            if num > len(self.virtual_free):
                return  # the router would not admit it
            virtual = tuple(self.virtual_free.pop() for _ in range(num))
        self.m.add_request(rid, virtual)
        self.reqs[rid] = Req(list(prompt), max_len, virtual)
        self._start(rid)

    @precondition(lambda self: any(r.state == "running" and len(r.history) < r.max_len for r in self.reqs.values()))
    @rule(data=st.data(), token=st.sampled_from(VOCAB))
    def decode(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(
            st.sampled_from([i for i in self._ids("running") if len(self.reqs[i].history) < self.reqs[i].max_len])
        )
        req = self.reqs[rid]
        allocation = self.m.allocate(rid, len(req.history) + 1)
        self.sim.apply_tier_moves(self.m)
        if allocation is None:
            return  # pool exhausted: the engine would preempt (another rule does)
        assert allocation.copies == ()
        req.history.append(token)
        self.sim.write(self.m, rid, req.history, len(req.history) - 1, len(req.history))
        self.m.commit_tokens(rid, req.history)
        req.num_written, req.last_step = len(req.history), 1

    @precondition(
        lambda self: any(r.state == "running" and len(r.history) + 2 <= r.max_len for r in self.reqs.values())
    )
    @rule(
        data=st.data(),
        token=st.sampled_from(VOCAB),
        draft=st.lists(st.sampled_from(VOCAB), min_size=1, max_size=4),
        accepted=st.integers(0, 4),
    )
    def speculative_decode(self, data: st.DataObject, token: int, draft: list[int], accepted: int) -> None:
        """A speculative step as the engine runs it: the next token plus a draft are backed and written, then
        the token and ``accepted`` draft tokens are kept (``truncate``). Rejected positions are written with
        other tokens first, so one leaking into a kept or retained block would show in the contents."""
        rid = data.draw(
            st.sampled_from([i for i in self._ids("running") if len(self.reqs[i].history) + 2 <= self.reqs[i].max_len])
        )
        req = self.reqs[rid]
        start = len(req.history)
        draft = draft[: req.max_len - start - 1]
        accepted = min(accepted, len(draft))
        allocation = self.m.allocate(rid, start + 1 + len(draft))
        self.sim.apply_tier_moves(self.m)
        if allocation is None:
            return  # a draft never preempts: the engine decodes one token instead
        assert allocation.copies == ()
        written = [*req.history, token, *draft[:accepted], *[(t + 1) % len(VOCAB) for t in draft[accepted:]]]
        self.sim.write(self.m, rid, written, start, len(written))
        req.history.extend([token, *draft[:accepted]])
        self.m.commit_tokens(rid, req.history)
        self.m.truncate(rid, len(req.history))
        assert self.m.request_memory(rid).num_blocks <= self.m.num_groups * -(-len(req.history) // self.BS)
        event("draft partly rejected" if accepted < len(draft) else "draft accepted")
        req.num_written, req.last_step = len(req.history), 1 + len(draft)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self._finish(data.draw(st.sampled_from(sorted(self.reqs))))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def filter_batch(self, data: st.DataObject) -> None:
        keep = data.draw(st.sets(st.sampled_from(sorted(self.reqs))))
        for rid in sorted(set(self.reqs) - keep):
            self._finish(rid)

    @rule(evict=st.booleans())
    def clear_cache(self, evict: bool) -> None:
        for rid in sorted(self.reqs):
            self._finish(rid)
        self._assert_pool_drained(evict)

    @precondition(lambda self: self._ids("running"))
    @rule(data=st.data(), swap=st.booleans())
    def preempt(self, data: st.DataObject, swap: bool) -> None:
        rid = data.draw(st.sampled_from(self._ids("running")))
        req = self.reqs[rid]
        if swap:
            possible = self.m.can_swap_out(rid)
            kept = self.m.tiers.counters.swap_kept_rows if self.m.tiers is not None else 0
            plan = self.m.swap_out(rid)
            assert (plan is not None) == possible
            if self.m.tiers is not None and self.m.tiers.counters.swap_kept_rows > kept:
                event("swap-out left blocks in the host tier")
            if plan is not None:
                event("swapped out" if not self.m.stats().num_hole_blocks else "swapped out, holes kept")
                self.sim.apply_swap(plan)
                req.state = "swapped"
                return
        assert self.m.preempt_recompute(rid) == req.num_written
        req.state, req.num_written = "dropped", 0

    @precondition(lambda self: self._ids("waiting", "swapped", "dropped"))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._ids("waiting", "swapped", "dropped")))
        req = self.reqs[rid]
        if req.state == "swapped":
            plan = self.m.swap_in(rid)
            self.sim.apply_tier_moves(self.m)
            if plan is not None:
                event("swapped in")
                self.sim.apply_swap(plan)
                req.state = "running"
        elif req.state == "dropped":
            self._start(rid)
        else:
            self._try_prefill(rid)

    @rule()
    def liveness_probe(self) -> None:
        used = self.m.num_used_blocks
        self.m.add_request(U64_MAX, (0,))
        assert self.m.match_prefix(U64_MAX, [1]).num_cached_tokens == 0
        assert self.m.allocate(U64_MAX, 1) is not None
        np.testing.assert_array_equal(self.m.slot_mapping([U64_MAX], [0], [1]), [0])
        assert self.m.num_used_blocks == used
        self.m.free(U64_MAX)

    # ---------------------------------------------------------------------------- invariants
    @invariant()
    def books_balance_and_contents_are_intact(self) -> None:
        self.m.check_invariants()
        stats = self.m.stats()
        assert stats.num_free_blocks + stats.num_used_blocks + stats.num_retained_blocks == self.NUM_BLOCKS - 1
        if self.WINDOW is None and self.GROUPS is None:
            assert stats.num_hole_blocks == 0 and stats.num_reclaimed_blocks_total == 0
        elif stats.num_hole_blocks:
            event("blocks behind the window given back")
        running = self._ids("running")
        if running:  # batched gathers agree with per-request slot mappings
            tables = self.m.block_tables(running)
            last = [self.reqs[rid].num_written - 1 for rid in running]
            slots = self.m.decode_slot_mapping(running, last)
            for i, (rid, pos) in enumerate(zip(running, last)):
                bs = self.BS
                assert slots[i] == tables[i, pos // bs] * bs + pos % bs
                assert slots[i] == self.m.slot_mapping([rid], [pos], [1])[0]
        for rid in running:
            req = self.reqs[rid]
            self.sim.assert_holds(  # what the next query (at num_written) reads
                self.m, rid, req.history, req.num_written, start=self._visible_from(req.num_written)
            )
            if self.WINDOW is not None:
                held = self.m.request_memory(rid).num_blocks
                assert held <= max_resident_blocks(self.WINDOW, self.BS, req.last_step), (rid, held)
            for window, page_map in zip(self.m.group_windows, self.m._maps(rid)):
                if window is not None and self.GROUPS is not None:  # each sliding group within its bound
                    held = page_map.num_physical_blocks
                    assert held <= max_resident_blocks(window, self.BS, req.last_step), (rid, window, held)
            if req.virtual:
                pos = np.arange(req.num_written)
                router_slots = np.asarray(req.virtual, dtype=np.int64)[pos // self.BS] * self.BS + pos % self.BS
                np.testing.assert_array_equal(
                    self.m.virtual_to_physical_slots(rid, router_slots),
                    self.m.slot_mapping([rid], [0], [req.num_written]),
                )

    def _assert_pool_drained(self, evict: bool) -> None:
        assert self.m.num_used_blocks == 0 and self.m.num_swapped_blocks == 0
        assert self.m.num_free_blocks + self.m.num_retained_blocks == self.NUM_BLOCKS - 1
        if evict:
            self.m.reset_prefix_cache()
            self.sim.apply_tier_moves(self.m)
            assert self.m.num_free_blocks == self.NUM_BLOCKS - 1
        self.m.check_invariants()

    def teardown(self) -> None:
        for rid in sorted(self.reqs):
            self._finish(rid)
        self._assert_pool_drained(evict=True)


MemoryMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None, derandomize=True)
TestMemoryMachine = MemoryMachine.TestCase


class MemoryMachineBlockSize1(MemoryMachine):
    """Token-granular pages (stock TGI's flashinfer layout): no partial blocks, no copy-on-write,
    every decode step maps a block. A pool of about the same token capacity as the one above."""

    BS = 1
    NUM_BLOCKS = 41
    NUM_SWAP_BLOCKS = 20
    NUM_VIRTUAL_BLOCKS = 160


MemoryMachineBlockSize1.TestCase.settings = settings(
    max_examples=40, stateful_step_count=50, deadline=None, derandomize=True
)
TestMemoryMachineBlockSize1 = MemoryMachineBlockSize1.TestCase


class MemoryMachineBlockSize2(MemoryMachine):
    """The smallest block size with a partial last block (one-token copy-on-write)."""

    BS = 2
    NUM_BLOCKS = 23
    NUM_SWAP_BLOCKS = 10
    NUM_VIRTUAL_BLOCKS = 90


MemoryMachineBlockSize2.TestCase.settings = settings(
    max_examples=25, stateful_step_count=50, deadline=None, derandomize=True
)
TestMemoryMachineBlockSize2 = MemoryMachineBlockSize2.TestCase


class WindowedMemoryMachine(MemoryMachine):
    """Sliding-window reclaim with a window that is not a multiple of the block size."""

    WINDOW = 6


WindowedMemoryMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, derandomize=True
)
TestWindowedMemoryMachine = WindowedMemoryMachine.TestCase


class WindowedMemoryMachineBlockSize1(MemoryMachine):
    """Token-granular pages under a 3-token window: a block leaves at almost every step."""

    BS = 1
    NUM_BLOCKS = 41
    NUM_SWAP_BLOCKS = 20
    NUM_VIRTUAL_BLOCKS = 160
    WINDOW = 3


WindowedMemoryMachineBlockSize1.TestCase.settings = settings(
    max_examples=30, stateful_step_count=50, deadline=None, derandomize=True
)
TestWindowedMemoryMachineBlockSize1 = WindowedMemoryMachineBlockSize1.TestCase


class HybridMemoryMachine(MemoryMachine):
    """Layer groups: a full group beside a sliding one (window 6: not a multiple of the block size), one
    pool; every group reads back its own history (codes salted per group) and no block is in two groups."""

    NUM_BLOCKS = 25
    NUM_SWAP_BLOCKS = 12
    GROUPS = (None, 6)


HybridMemoryMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None, derandomize=True
)
TestHybridMemoryMachine = HybridMemoryMachine.TestCase


class HybridMemoryMachineBlockSize1(MemoryMachine):
    """Three groups of two windows at token granularity."""

    BS = 1
    NUM_BLOCKS = 81
    NUM_SWAP_BLOCKS = 40
    NUM_VIRTUAL_BLOCKS = 160
    GROUPS = (None, 3, 3)


HybridMemoryMachineBlockSize1.TestCase.settings = settings(
    max_examples=25, stateful_step_count=50, deadline=None, derandomize=True
)
TestHybridMemoryMachineBlockSize1 = HybridMemoryMachineBlockSize1.TestCase


class HybridMemoryMachineSlidingAnchor(MemoryMachine):
    """Two sliding groups, no full one: the anchor of prefix retention gives blocks back too."""

    NUM_BLOCKS = 25
    NUM_SWAP_BLOCKS = 12
    GROUPS = (6, 3)


HybridMemoryMachineSlidingAnchor.TestCase.settings = settings(
    max_examples=30, stateful_step_count=50, deadline=None, derandomize=True
)
TestHybridMemoryMachineSlidingAnchor = HybridMemoryMachineSlidingAnchor.TestCase


class TieredMemoryMachine(MemoryMachine):
    """A host tier of 6 rows below a 13-block pool: evicted retained blocks are offloaded and loaded back
    (issue order); every request still reads back exactly its own history."""

    HOST_ROWS = 6


TieredMemoryMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, derandomize=True
)
TestTieredMemoryMachine = TieredMemoryMachine.TestCase


class TieredHybridMemoryMachine(MemoryMachine):
    """The host tier with a full and a sliding group: an entry keeps each group's block (or its hole)."""

    NUM_BLOCKS = 25
    NUM_SWAP_BLOCKS = 12
    GROUPS = (None, 6)
    HOST_ROWS = 10


TieredHybridMemoryMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None, derandomize=True
)
TestTieredHybridMemoryMachine = TieredHybridMemoryMachine.TestCase
