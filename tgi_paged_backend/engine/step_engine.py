"""The request table and one step over it: what every RPC of the shard engine shares.

:class:`StepEngine` holds the live requests (:class:`RequestState` by id) and, over a pool of a given
capacity (``_configure``), the memory manager, the scheduler and the model step. ``_step`` runs one
step for a list of request ids: drafts, plan, forward, the bookkeeping after it, and one
:class:`~tgi_paged_backend.telemetry.step_record.StepRecord` handed to the one telemetry observer
(``observer``; which sinks listen is decided where the engine is built). It knows nothing of batches,
RPCs or Warmup: :class:`~.shard_engine.PagedShardEngine` adds them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tgi_paged_backend.config import BackendConfig
from tgi_paged_backend.engine.capacity import Capacity
from tgi_paged_backend.engine.detokenize import TokenDecoder
from tgi_paged_backend.engine.engine_stats import EngineStats
from tgi_paged_backend.engine.grammar import GrammarCompiler, GrammarState, TokenVocabulary
from tgi_paged_backend.engine.image_prompts import ImagePrompts, RequestImages
from tgi_paged_backend.engine.model_step import ModelStep
from tgi_paged_backend.engine.request_state import RequestState, RequestStatus
from tgi_paged_backend.engine.scheduler import Scheduler, reuse_cached_prefix
from tgi_paged_backend.engine.speculation import drafting_pays, propose_drafts
from tgi_paged_backend.engine.step_anatomy import StepTimer, device_sync
from tgi_paged_backend.engine.stopping import StoppingCriteria, eos_token_ids
from tgi_paged_backend.engine.tokenize import PromptTokenizer
from tgi_paged_backend.engine.types import RequestSpec
from tgi_paged_backend.lora.sources import AdapterNames
from tgi_paged_backend.memory.kv_cache_manager import KVCacheManager
from tgi_paged_backend.memory.prefix_tiers import TierObserver
from tgi_paged_backend.offload.disk_store import DiskStore
from tgi_paged_backend.offload.tier_setup import build_kv_tiers
from tgi_paged_backend.policy.preemption_mode import RateCalibrator, choose_preemption_mode
from tgi_paged_backend.runner.model_runner import ModelRunner
from tgi_paged_backend.telemetry.disk_events import DiskTierEvents
from tgi_paged_backend.telemetry.engine_adapter import StepRecordBuilder
from tgi_paged_backend.telemetry.step_record import StepRecord
from tgi_paged_backend.telemetry.tier_stats import collect_tier_stats

if TYPE_CHECKING:
    from tgi_paged_backend.telemetry.sinks import ShardTelemetry

IDLE_WAIT_S = 0.005
"""Pause when a step could do nothing (every request waits), so back-to-back Decodes don't spin."""


class StepEngine:
    """Live requests and the step over them; :class:`~.shard_engine.PagedShardEngine` is the one to build."""

    def __init__(self, config: BackendConfig, runner: ModelRunner, telemetry: ShardTelemetry) -> None:
        self.config = config
        self.runner = runner
        self.block_size = config.cache.block_size
        self.prompt_tokenizer = PromptTokenizer(runner.tokenizer)
        self.image_prompts = ImagePrompts.for_runner(runner, self.prompt_tokenizer)
        """Prompts with images (a served vision-language model), else ``None``: text only."""
        self.decoder = TokenDecoder(runner.tokenizer)
        self.eos_ids = eos_token_ids(runner.tokenizer, runner.generation_config) or frozenset(runner.eos_token_ids)
        self.calibrator = RateCalibrator()
        self.stats = EngineStats()
        self.observer = telemetry.observer
        """The one telemetry observer: each step's record, snapshots after RPCs, the budget, a new pool."""
        self.recorder = telemetry.recorder
        """The metrics recorder (subscribed to :attr:`observer`; the engine reports only to the observer)."""
        self.last_step: StepRecord | None = None
        self._sync, self._telemetry_ns = device_sync(runner.device.type), 0  # step anatomy
        self.requests: dict[int, RequestState] = {}
        self._admitted = 0
        self._grammar: GrammarCompiler | None = None
        self.adapter_names = AdapterNames(runner.lora.names if runner.lora is not None else ())
        """``adapter_id`` -> LoRA adapter index (0: the base model); counts the unknown ids."""
        self.step_records = StepRecordBuilder(adapters=self.adapter_names, max_loras=config.model.max_loras)
        self.kv_events = telemetry.kv_events
        """KV-cache events for a prefix-aware router, else a no-op: the memory manager reports to it."""
        self._spec_max_batch = config.model.speculate_max_batch or (1 if runner.device.type == "cpu" else None)
        """Decoding requests up to which a step drafts (``ModelConfig.speculate_max_batch``)."""
        self._pool_built = False
        self._disk: DiskStore | None = None
        """The disk tier's store, opened at the first pool and kept when Warmup rebuilds it."""
        self._disk_events = DiskTierEvents()
        self._tier_events = self.kv_events if isinstance(self.kv_events, TierObserver) else None
        """The KV tiers' observer: the KV-events publisher (both sinks are TierObservers)."""
        """The disk tier's KV events (medium DISK), published from this thread after each step."""

    # -- the pool ---------------------------------------------------------------------------

    def _configure(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.runner.allocate_kv_cache(capacity.num_blocks, grouped=self.runner.kv_groups.num_groups > 1)
        swap_blocks = self.config.cache.swap_space_bytes // self.runner.block_bytes
        if self.config.preemption.mode == "recompute":
            swap_blocks = 0
        self.runner.allocate_swap_space(swap_blocks)
        self.tier_io, tiers, self._disk = build_kv_tiers(
            self.config,
            self.runner,
            swap_bytes=swap_blocks * self.runner.block_bytes,
            disk=self._disk,
            observer=self._tier_events,  # the tiers' KV events (medium CPU; DISK: _publish_disk_events)
        )
        if self._pool_built:  # a new pool: every block the old one retained is gone
            self.observer.on_pool_reset()
            self._disk_events = DiskTierEvents()  # AllBlocksCleared cleared the DISK blocks announced too
        self._pool_built = True
        self.kv = KVCacheManager(
            num_blocks=capacity.num_blocks,
            block_size=self.block_size,
            num_swap_blocks=swap_blocks,
            enable_prefix_retention=self.config.cache.prefix_caching,  # PREFIX_CACHING
            observer=self.kv_events,
            groups=self.runner.kv_groups.windows,  # one group: the reclaim window of every layer, if any
            tiers=tiers,  # TGI_PAGED_HOST_CACHE_GB, TGI_PAGED_DISK_CACHE_DIR
        )
        self.scheduler = Scheduler(
            self.kv,
            max_batch_tokens=capacity.max_prefill_tokens,
            max_preemptions=self.config.preemption.max_preemptions_per_request,
            choose_mode=self._choose_mode,
            cost_aware=self.config.preemption.cost_aware_victims,
            max_loras=self.config.model.max_loras,
        )
        self.model_step = ModelStep(self.runner, self.kv, self.decoder, self._spec_max_batch, self.tier_io)

    def _choose_mode(self, victim: RequestState, swap_has_room: bool) -> tuple[str, float]:
        decision = choose_preemption_mode(
            self.config.preemption.mode,
            num_tokens_to_reprefill=victim.num_computed + 1,
            num_swap_bytes=self.kv.request_memory(victim.id).num_blocks * self.runner.block_bytes,
            swap_has_room=swap_has_room,
            calibrator=self.calibrator,
        )
        cost = decision.swap_cost_s if decision.mode == "swap" else decision.recompute_cost_s
        return decision.mode, float(cost or 0.0)

    # -- requests ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop grammar compiles; finish the disk tier's writes; close telemetry (the last OTLP export,
        pending preemption summaries, KV events)."""
        try:
            if self._grammar is not None:
                self._grammar.close()
            if self._disk is not None:
                self.tier_io.persist(self.kv)  # the pool's retained blocks, to disk (bounded)
                self._disk.close()
                self._publish_disk_events()
        finally:
            self.observer.close()

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Built at the first grammar request (the vocabulary scan costs a few hundred ms)."""
        if self._grammar is None:
            eos = self.runner.tokenizer.eos_token_id
            self._grammar = GrammarCompiler(TokenVocabulary(self.runner.tokenizer, eos))
        return self._grammar

    def _encode_prompts(self, specs: Sequence[RequestSpec]) -> tuple[list[list[int]], list[RequestImages | None]]:
        """Prompt ids of ``specs`` (and their images, a vision-language model's; ``InvalidRequestError`` for a
        bad one); a text-only model reads each request's text and ignores images, as stock."""
        if self.image_prompts is None:
            return self.prompt_tokenizer.encode_requests(specs), [None] * len(specs)
        return self.image_prompts.encode_requests(specs)

    def _register(
        self, spec: RequestSpec, prompt_ids: list[int], grammar: GrammarState | None, images: RequestImages | None
    ) -> None:
        """Create the request state and its page map; share retained prefix blocks."""
        self._admitted += 1
        state = RequestState(
            spec=spec,
            prompt_ids=prompt_ids,
            admitted_seq=self._admitted,
            chunk_len_hint=spec.chunk_len,
            grammar=grammar,
            images=images,
            wants_prompt_logprobs=spec.prefill_logprobs and self.config.server.request_logprobs,
        )
        state.stop_state = StoppingCriteria(spec.stopping, self.eos_ids)
        state.detok_state = self.decoder.new_request(prompt_ids)
        state.adapter = self.adapter_names.resolve(spec.adapter_id)
        slack = 0 if self.image_prompts is None else self.image_prompts.router_slack(spec)  # PaliGemma's wrap
        self.kv.add_request(spec.id, spec.blocks, namespace=state.adapter, extra=-(-slack // self.block_size))
        self.requests[spec.id] = state
        if self.tier_io.disk is not None and state.may_reuse_prefix:  # the disk tier's blocks go to the host tier
            fetched = self.tier_io.fetch(self.kv, state.prompt_keys, state.adapter, self._agree_min)
            self.stats.disk_hit_tokens += fetched * self.block_size
        self.stats.prefix_hit_tokens += reuse_cached_prefix(self.kv, state)
        self.stats.prefix_query_tokens += len(prompt_ids)

    # -- the step ---------------------------------------------------------------------------

    def _step(self, ids: list[int], batch_id: int | None = None):
        """One step for ``ids``; ``batch_id``: the router's batch they are (``None``: Warmup, liveness)."""
        t0 = time.perf_counter()
        timer = StepTimer(self._sync)
        timer.add("telemetry", self._telemetry_ns)
        step = self._without_compiling([self.requests[rid] for rid in ids])
        speculate = self.config.model.num_speculative_tokens if drafting_pays(step, self._spec_max_batch) else 0
        propose_drafts(step, speculate, self.runner.medusa is not None)
        in_step = {r.id for r in step}
        others = [r for rid, r in self.requests.items() if rid not in in_step]
        plan = self.scheduler.plan(step, others)
        timer.lap("schedule")
        out = self.model_step.run(plan, timer)
        if self.kv.tiers is not None:
            self.tier_io.settle()  # CUDA: the offloads' transfers ran beside the forward; wait for them now
            self.kv.tiers.moves_landed()  # the step's copies ran: what they offloaded is loadable
        self._publish_disk_events()
        step_s = time.perf_counter() - t0
        if not plan.scheduled:
            time.sleep(IDLE_WAIT_S)
        elif out.num_computed_tokens > len(plan.scheduled):  # depends on the plan only (same on every rank)
            self.calibrator.observe_prefill(out.num_computed_tokens, out.forward_ns / 1e9)
        if out.num_swapped_blocks:  # measured swap rate (the plan decides: same on every rank)
            self.calibrator.observe_copy(out.num_swapped_blocks * self.runner.block_bytes, out.copy_ns / 1e9)
        self.stats.record_step(plan, out, swap_block_bytes=self.runner.block_bytes)
        self._free([r.id for r in out.finished])
        timer.lap("schedule")
        t_telemetry = time.perf_counter_ns()
        self.last_step = self.step_records.build(
            plan=plan,
            out=out,
            memory=self.kv.stats(),
            step_s=step_s,
            swap_block_bytes=self.runner.block_bytes,
            requests=self.requests.values(),
            grammar=self._grammar,
            part_s=timer.seconds(),
            batch_id=batch_id,
            batch_requests=len(ids),
            tiers=collect_tier_stats(
                self.kv,
                self.tier_io,
                self._disk,
                prefix_hit_tokens=self.stats.prefix_hit_tokens,
                disk_hit_tokens=self.stats.disk_hit_tokens,
            ),
        )
        self.observer.on_step(self.last_step)
        self._telemetry_ns = time.perf_counter_ns() - t_telemetry
        return out.generations, out.forward_ns, out.decode_ns

    def _publish_disk_events(self) -> None:
        """The disk writer's files since the last call, as KV events of this step's batch."""
        if self._disk is not None and self._tier_events is not None:
            self._disk_events.publish(self._disk, self._tier_events)

    def _without_compiling(self, step: list[RequestState]) -> list[RequestState]:
        """``step`` less the requests whose grammar is still compiling: those wait in the batch (as
        others of this step), holding nothing new and yielding no token, while the rest step."""
        constrained = [r for r in step if r.grammar is not None]
        if not constrained:
            return step
        ready = self._agree_ready([r.grammar.ready for r in constrained])  # type: ignore[union-attr]
        compiling = {r.id for r, ok in zip(constrained, ready) if not ok}
        return [r for r in step if r.id not in compiling]

    def _agree_min(self, value: int) -> int:
        """The smallest ``value`` over every rank (one rank: this one's)."""
        return value

    def _agree_ready(self, flags: list[bool]) -> list[bool]:
        """Which grammars every rank has compiled (one rank: this one's view)."""
        return flags

    def _record_memory(self) -> None:
        """Report the pool and the live requests after an RPC freed requests outside a step."""
        self.observer.on_snapshot(self.step_records.snapshot(memory=self.kv.stats(), requests=self.requests.values()))

    def _free(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                if state.status is not RequestStatus.FINISHED:
                    state.status = RequestStatus.FINISHED
                self.kv.free(rid)
