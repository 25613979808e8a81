"""Plans one forward step: which requests compute how many tokens, and who is preempted.

Priority is admission order (oldest first), with protected requests (preempted the maximum number of
times) ahead of all others. Preempted requests keep their admission number, so they resume before
anything admitted after them, and a request only ever takes blocks from requests after it in
priority order (vLLM's rule). The first request can therefore always make progress as long as one
request fits in the pool (Warmup guarantees that), so nothing deadlocks.

Per step:
1. swapped requests try to swap back in (preempting later-admitted ones if needed);
2. every request gets its token count (1 to decode, plus its speculative draft when the pool backs it
   without preempting; a prefill chunk within the token budget);
3. its physical blocks are allocated, preempting later-admitted victims until they fit; when no
   victim is left it simply waits this step (no Generation, it stays in the batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tgi_paged_backend.engine.request_state import RequestState, RequestStatus
from tgi_paged_backend.memory.kv_cache_manager import KVCacheManager
from tgi_paged_backend.policy.lora_slots import may_run_adapter
from tgi_paged_backend.policy.victims import VictimCandidate, victim_order
from tgi_paged_backend.vision.attend_spans import chunk_tokens


@dataclass(frozen=True, slots=True)
class PreemptionEvent:
    request_id: int
    mode: str
    """``swap`` or ``recompute``."""
    num_tokens: int
    """Tokens whose K/V were swapped out or dropped."""
    estimated_cost_s: float


@dataclass(slots=True)
class StepPlan:
    """What the model step must do: the block copies in issue order, then one forward."""

    scheduled: list[tuple[RequestState, int]] = field(default_factory=list)
    copy_ops: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    """``(kind, src ids, dst ids)`` in the order the memory manager issued them (a block released by
    one may be reused by a later one): ``out`` device -> cpu, ``in`` cpu -> device, ``cow`` in-pool,
    ``offload`` pool -> host tier, ``load`` host tier -> pool."""
    preemptions: list[PreemptionEvent] = field(default_factory=list)
    resumed_wait_s: list[float] = field(default_factory=list)
    num_new_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


ChooseMode = Callable[[RequestState, bool], tuple[str, float]]
"""(victim, swap possible) -> (mode, estimated cost in seconds)."""


class Scheduler:
    """Stateless planner over the KV cache manager; the engine owns the requests."""

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_batch_tokens: int,
        max_preemptions: int,
        choose_mode: ChooseMode,
        cost_aware: bool = False,
        max_loras: int | None = None,
    ) -> None:
        self.kv = kv
        self.max_loras = max_loras
        self.cost_aware = cost_aware
        self.max_batch_tokens = max_batch_tokens
        self.max_preemptions = max_preemptions
        self.choose_mode = choose_mode

    def plan(self, step: list[RequestState], others: Iterable[RequestState]) -> StepPlan:
        """Plan one step for ``step`` (the merged batch); ``others`` may lose blocks to it."""
        plan = StepPlan()
        self._take_tier_moves(plan)  # issued at admission (a match's loads), before anything of this step
        live = sorted((r for r in step if r.status is not RequestStatus.FINISHED), key=self.priority)
        victims_pool = sorted(
            {id(r): r for r in [*live, *others] if r.status is not RequestStatus.FINISHED}.values(), key=self.priority
        )
        num_decodes = sum(1 for r in live if not r.is_preempted and r.num_remaining == 1)
        prefill_budget = max(self.max_batch_tokens - num_decodes, 0)
        prefilled = False  # a prefill chunk is planned already: a bidirectional span must fit what is left
        adapters: set[int] = set()
        for request in live:
            if request.status is RequestStatus.FINISHED or request.id in _preempted(plan):
                continue  # preempted earlier in this step by an older request: wait
            request.waiting_for_adapter = not may_run_adapter(request.adapter, adapters, self.max_loras)
            if request.waiting_for_adapter:  # max_loras other adapters run this step
                self._release_if_waiting(request)
                continue
            if request.status is RequestStatus.SWAPPED and not self._swap_in(request, victims_pool, plan):
                continue
            if request.status is RequestStatus.PREEMPTED:  # resume: share what is still retained
                reuse_cached_prefix(self.kv, request)
                self._take_tier_moves(plan)
            if request.draft and not self._allocate_draft(request, plan):
                request.draft = []  # the pool cannot back the draft without preempting: decode one token
            n = self._num_tokens(request, prefill_budget, prefilled)
            request.waiting_for_blocks = (  # a draft's blocks are allocated already (allocate once per step:
                n > 0  # the sliding-window release reads where the step's first query is)
                and not request.draft
                and not self._allocate(request, request.num_computed + n, victims_pool, plan)
            )
            if n == 0 or request.waiting_for_blocks:
                self._release_if_waiting(request)
                continue
            if request.status is RequestStatus.PREEMPTED:
                plan.resumed_wait_s.append(request.mark_resumed())
            if request.num_remaining > 1:  # a prefill chunk (a decode's draft tokens do not count)
                prefill_budget = max(prefill_budget - n, 0)
                prefilled = True
            plan.scheduled.append((request, n))
            if request.adapter:
                adapters.add(request.adapter)
        return plan

    def priority(self, request: RequestState) -> tuple[int, int]:
        """Sort key, smallest first: protected requests (preempted ``max_preemptions`` times), then
        admission order. A request only takes blocks from requests after it in this order, so the
        first one always progresses (no deadlock) and protected requests are never preempted by
        unprotected ones."""
        return (0 if request.num_preemptions >= self.max_preemptions else 1, request.admitted_seq)

    # -- phases ------------------------------------------------------------------------------

    def _num_tokens(self, request: RequestState, prefill_budget: int, prefilled: bool) -> int:
        """Decode: 1 plus the draft. A prefill chunk: what the budget (and the router's first ``chunk_len``) allows,
        its end moved out of any bidirectional span (``vision.attend_spans.chunk_tokens``): a span taken whole may
        use the whole prefill budget when it is the step's first prefill chunk (decodes ride along, as stock's
        budget counts prefill tokens only), else only what is left; admission refused longer spans."""
        remaining = request.num_remaining
        if remaining == 1:
            return 1 + len(request.draft)
        n = min(remaining, prefill_budget)
        if request.chunk_len_hint is not None:
            n = min(n, request.chunk_len_hint)
        if request.attend_spans and n > 0:
            room = prefill_budget if prefilled else self.max_batch_tokens
            n = chunk_tokens(request.attend_spans, request.num_computed, n, room)
        return max(n, 0)

    def _swap_in(self, request: RequestState, victims_pool: list[RequestState], plan: StepPlan) -> bool:
        while (swap := self.kv.swap_in(request.id)) is None:
            if not self._preempt_one_after(request, victims_pool, plan):
                return False
        self._take_tier_moves(plan)
        plan.copy_ops.append(("in", list(swap.src_blocks), list(swap.dst_blocks)))
        plan.resumed_wait_s.append(request.mark_resumed())
        return True

    def _take_tier_moves(self, plan: StepPlan) -> None:
        """The host tier's copies issued by the last manager call go before that call's own copies
        (an evicted block is offloaded before it is written again)."""
        plan.copy_ops.extend(self.kv.take_tier_moves())

    def _release_if_waiting(self, request: RequestState) -> None:
        """A request that could not run this step and has computed nothing of its own gives back the
        prefix blocks it shares (and any copy-on-write pin): held by a waiting request they could
        neither be evicted nor taken as a victim's, and the first request in priority order could
        starve. It is matched against the retained prefix again when it next runs."""
        if request.status is RequestStatus.PREEMPTED:
            self.kv.preempt_recompute(request.id)
            request.drop_computed()
        elif (
            request.status is RequestStatus.RUNNING
            and not request.prefill_done
            and 0 < request.num_computed == request.num_cached_prompt
        ):
            self.kv.preempt_recompute(request.id)
            request.mark_waiting()

    def _allocate(
        self, request: RequestState, num_tokens: int, victims_pool: list[RequestState], plan: StepPlan
    ) -> bool:
        while (allocation := self.kv.allocate(request.id, num_tokens)) is None:
            if not self._preempt_one_after(request, victims_pool, plan):
                return False
        self._take_tier_moves(plan)
        for copy in allocation.copies:
            plan.copy_ops.append(("cow", [copy.src], [copy.dst]))
        plan.num_new_blocks += len(allocation.new_blocks)
        return True

    def _allocate_draft(self, request: RequestState, plan: StepPlan) -> bool:
        """Back the next token and the draft after it if the pool has the blocks; never preempts for a draft."""
        allocation = self.kv.allocate(request.id, request.num_computed + 1 + len(request.draft))
        if allocation is None:
            return False
        self._take_tier_moves(plan)
        for copy in allocation.copies:
            plan.copy_ops.append(("cow", [copy.src], [copy.dst]))
        plan.num_new_blocks += len(allocation.new_blocks)
        return True

    def _preempt_one_after(self, request: RequestState, victims_pool: list[RequestState], plan: StepPlan) -> bool:
        """Preempt one request after ``request`` in priority order that holds blocks.

        The policy's victim order leaves protected requests out; only when nothing else is left is a
        protected one taken (the latest in priority order), so the first request never starves.
        """
        rank = self.priority(request)
        holders: list[RequestState] = []
        candidates = []
        for victim in victims_pool:
            if self.priority(victim) <= rank or victim.status is not RequestStatus.RUNNING:
                continue
            memory = self.kv.request_memory(victim.id)
            if memory.num_blocks == 0:
                continue
            holders.append(victim)
            candidates.append(
                VictimCandidate(
                    request_id=victim.id,
                    admission_seq=victim.admitted_seq,
                    num_preemptions=victim.num_preemptions,
                    num_freeable_blocks=memory.num_exclusive_blocks,
                    estimated_cost_s=self.choose_mode(victim, False)[1] if self.cost_aware else 0.0,
                )
            )
        if not holders:
            return False
        order = victim_order(candidates, max_preemptions=self.max_preemptions, cost_aware=self.cost_aware)
        by_id = {v.id: v for v in holders}
        victim = by_id[order[0].request_id] if order else max(holders, key=self.priority)
        self._preempt(victim, plan)
        return True

    def _preempt(self, victim: RequestState, plan: StepPlan) -> None:
        plan.scheduled = [(r, n) for r, n in plan.scheduled if r is not victim]
        victim.draft = []
        mode, cost = self.choose_mode(victim, self.kv.can_swap_out(victim.id))
        num_tokens = victim.num_computed
        if mode == "swap" and (swap := self.kv.swap_out(victim.id)) is not None:
            plan.copy_ops.append(("out", list(swap.src_blocks), list(swap.dst_blocks)))
            victim.mark_preempted(RequestStatus.SWAPPED)
        else:
            mode = "recompute"
            self.kv.preempt_recompute(victim.id)
            victim.mark_preempted(RequestStatus.PREEMPTED)
        plan.preemptions.append(PreemptionEvent(victim.id, mode, num_tokens, cost))


def reuse_cached_prefix(kv: KVCacheManager, request: RequestState) -> int:
    """The one prefix match, at admission and at a recompute resume: share the retained blocks that
    hold the request's leading tokens and start computing after them. A request that must compute its
    prompt itself (prompt logprobs, prefill not done) shares nothing. Returns the cached tokens."""
    if not request.may_reuse_prefix:
        return 0
    num_cached = kv.match_prefix(request.id, request.key_ids).num_cached_tokens  # images keyed by content
    request.start_from_cache(num_cached)
    return num_cached


def _preempted(plan: StepPlan) -> set[int]:
    return {e.request_id for e in plan.preemptions}
