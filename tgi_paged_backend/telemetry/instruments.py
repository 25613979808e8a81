"""The ``tgi_paged_*`` instruments: names and descriptions, histogram buckets, and how each is made.

:class:`OtelInstruments` creates every instrument of :data:`METRIC_NAMES` on a meter and answers the
observable gauges from the latest snapshots (pool, requests, budget, LoRA usage, speculative totals),
so an exporter thread never calls into the engine. Feeding them, once per step and per RPC, is
:class:`~tgi_paged_backend.telemetry.recorder.OtelRecorder`'s part.
"""

from __future__ import annotations

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

from tgi_paged_backend.memory.stats import MemoryStats
from tgi_paged_backend.telemetry.lora_usage import LoraUsage
from tgi_paged_backend.telemetry.step_record import (
    PHASES,
    PREEMPTION_MODES,
    STEP_PARTS,
    SWAP_DIRECTIONS,
    MemoryBudget,
)
from tgi_paged_backend.telemetry.tier_stats import TIER_DIRECTIONS, TIERS, TierStats

METER_NAME = "tgi_paged_backend"

STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STEP_PART_SECONDS_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
WAIT_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
COMPILE_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

METRIC_NAMES: dict[str, str] = {
    # pool (gauges)
    "tgi_paged_kv_blocks": "Physical KV blocks by state (free, used, retained prefix, swapped to CPU)",
    "tgi_paged_kv_usage_ratio": "Used physical blocks over usable physical blocks",
    "tgi_paged_kv_physical_tokens": "Token capacity of the physical KV pool (with KV layer groups: the "
    "positions every group can hold)",
    "tgi_paged_kv_virtual_reserved_tokens": "Slots the router reserved for live requests",
    "tgi_paged_kv_window_reclaimed_blocks": "Blocks of live requests given back behind the sliding window "
    "(holes: stock TGI would still hold them)",
    "tgi_paged_kv_group_blocks": "With KV layer groups: blocks each group holds for live requests (state=held) "
    "and has given back behind its window (state=reclaimed), by group and window",
    "tgi_paged_kv_group_waste_ratio": "With KV layer groups: each group's internal waste (unfilled slots of the "
    "blocks it holds over their slots), by group and window",
    "tgi_paged_kv_waste_ratio": "KV waste by kind (internal: unfilled last-block slots; reservation: "
    "reserved but unbacked slots; external: stranded free blocks)",
    "tgi_paged_device_memory_bytes": "Total device memory",
    "tgi_paged_weights_bytes": "Model weights resident on this shard",
    "tgi_paged_activation_peak_bytes": "Profiled activation peak",
    "tgi_paged_kv_pool_bytes": "Physical KV pool size",
    "tgi_paged_swap_space_bytes": "CPU swap space for swapped-out KV blocks",
    "tgi_paged_lora_weights_bytes": "LoRA adapters' weights resident on this shard (part of the weights)",
    "tgi_paged_requests": "Live requests by state (running: holding KV blocks; waiting: admitted, no blocks "
    "yet; preempted)",
    "tgi_paged_queued_requests": "Requests queued in the shard: waiting for KV blocks or preempted (the "
    "inference gateway's queued-requests signal; the router's own queue is its tgi_queue_size)",
    "tgi_paged_cache_config_info": "KV pool geometry: labels block_size and num_gpu_blocks (usable physical "
    "blocks); value 1",
    "tgi_paged_preempted_max_wait_seconds": "Longest current wait among preempted requests",
    # preemption and prefix cache (counters, histogram)
    "tgi_paged_preemptions_total": "Requests preempted, by mode",
    "tgi_paged_computed_tokens_total": "Tokens computed by forward steps (prompt, generated and recomputed)",
    "tgi_paged_recomputed_tokens_total": "Tokens computed again after recompute-mode preemption",
    "tgi_paged_swap_bytes_total": "Bytes copied between device and CPU swap, by direction",
    "tgi_paged_preempted_wait_seconds": "Time a resumed request spent preempted",
    "tgi_paged_prefix_hit_tokens_total": "Prompt tokens served from the prefix cache",
    "tgi_paged_prefix_query_tokens_total": "Prompt tokens looked up in the prefix cache",
    "tgi_paged_image_tokens_total": "Image placeholder positions computed (vision-language models)",
    "tgi_paged_images_encoded_total": "Images run through the vision tower (again after recompute preemption)",
    # steps (histograms)
    "tgi_paged_step_seconds": "Engine step wall time, by phase (steps that computed nothing excluded)",
    "tgi_paged_step_part_seconds": "Engine step wall time by phase and part (schedule, copy, prepare, forward, "
    "sample, detokenize, telemetry; steps that computed nothing excluded)",
    "tgi_paged_batch_size": "Requests computed per step (steps that computed nothing excluded)",
    # structured output
    "tgi_paged_grammar_compile_seconds": "Time to compile one grammar (regex automaton over the vocabulary)",
    "tgi_paged_grammar_cache_hits_total": "Grammar requests whose automaton was already compiled (or compiling)",
    "tgi_paged_constrained_rows": "Grammar-constrained rows sampled per step (steps with none excluded)",
    # speculative decoding
    "tgi_paged_spec_draft_tokens_total": "Speculative tokens proposed and verified (--speculate)",
    "tgi_paged_spec_accepted_tokens_total": "Speculative tokens accepted (each saves one forward step)",
    "tgi_paged_spec_acceptance_ratio": "Accepted over proposed speculative tokens since start (0 before any)",
    # LoRA adapters
    "tgi_paged_lora_requests_info": "LoRA adapters in use: labels max_lora, running_lora_adapters and "
    "waiting_lora_adapters (comma-separated names); value: Unix time of the last update",
    "tgi_paged_lora_requests": 'Live requests by LoRA adapter (adapter="": the base model) and state '
    "(running, waiting: for an adapter slot, for memory or preempted)",
    "tgi_paged_lora_unknown_adapter_requests_total": "Requests whose adapter_id named no loaded adapter "
    "(served by the base model, as stock)",
    # KV tiers below the pool (TGI_PAGED_HOST_CACHE_GB, TGI_PAGED_DISK_CACHE_DIR; absent when off)
    "tgi_paged_kv_tier_hit_tokens_total": "Prefix-hit prompt tokens by the tier that served them (pool; host: "
    "loaded back from host RAM; disk: read from disk, then loaded); they add up to prefix_hit_tokens",
    "tgi_paged_kv_tier_moved_bytes_total": "Bytes moved between KV tiers, by direction (offload: pool to host, "
    "load: host to pool, spill: host to disk files, fetch: disk to host)",
    "tgi_paged_kv_tier_moved_seconds_total": "Seconds spent moving them, by direction (spill: the disk "
    "writer thread's time)",
    "tgi_paged_kv_host_tier_rows": "Host-tier arena rows (one per KV layer group of a block), by state (used, total)",
    "tgi_paged_kv_disk_tier_files": "Block files the disk tier holds",
    "tgi_paged_kv_disk_tier_bytes": "Disk-tier size, by state (used; max: TGI_PAGED_DISK_CACHE_GB)",
    "tgi_paged_kv_tier_dropped_blocks_total": "Blocks a tier let go, by tier and reason (host: evicted for room, "
    "no_room when every row was pinned; disk: evicted for room, ignored files that failed validation, "
    "write_error, queue_full)",
    "tgi_paged_kv_tier_swap_kept_blocks_total": "Blocks swap preemptions left in the host tier instead of "
    "copying them to swap space (swap-in loads them back from there)",
}


class OtelInstruments:
    """The instruments and the gauges' callbacks; the recorder that subclasses it sets the snapshots."""

    _memory: MemoryStats | None
    """The pool right after the last step or RPC (``None`` before the first)."""
    _requests: tuple[int, int, float, int]
    """(running, preempted, longest preempted wait in seconds, waiting) live requests."""
    _budget: MemoryBudget | None
    """How memory was split at the last sizing (``None`` before Warmup)."""
    _lora: LoraUsage
    """Live requests per LoRA adapter."""
    _spec_totals: tuple[int, int]
    """(proposed, accepted) speculative tokens since start, for the acceptance-ratio gauge."""
    _tiers: TierStats | None
    """The KV tiers after the last step (``None``: none configured, or before the first step)."""

    def _create_instruments(self, meter: Meter) -> None:
        self._phase_attrs = {p: {"phase": p} for p in PHASES}
        self._part_attrs = {p: {part: {"phase": p, "part": part} for part in STEP_PARTS} for p in PHASES}
        self._mode_attrs = {m: {"mode": m} for m in PREEMPTION_MODES}
        self._direction_attrs = {d: {"direction": d} for d in SWAP_DIRECTIONS}

        def gauge(name: str, unit: str, callback) -> None:
            meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=METRIC_NAMES[name])

        def counter(name: str, unit: str):
            return meter.create_counter(name, unit=unit, description=METRIC_NAMES[name])

        def histogram(name: str, unit: str):
            return meter.create_histogram(name, unit=unit, description=METRIC_NAMES[name])

        gauge("tgi_paged_kv_blocks", "{block}", self._observe_blocks)
        gauge("tgi_paged_kv_usage_ratio", "1", self._pool(lambda m: m.usage_ratio))
        gauge("tgi_paged_kv_physical_tokens", "{token}", self._pool(lambda m: m.num_physical_tokens))
        gauge("tgi_paged_kv_virtual_reserved_tokens", "{token}", self._pool(lambda m: m.num_reserved_slots))
        gauge("tgi_paged_kv_window_reclaimed_blocks", "{block}", self._pool(lambda m: m.num_hole_blocks))
        gauge("tgi_paged_kv_group_blocks", "{block}", self._observe_groups)
        gauge("tgi_paged_kv_group_waste_ratio", "1", self._observe_group_waste)
        gauge("tgi_paged_kv_waste_ratio", "1", self._observe_waste)
        gauge("tgi_paged_requests", "{request}", self._observe_requests)
        gauge("tgi_paged_queued_requests", "{request}", self._observe_queued)
        gauge("tgi_paged_cache_config_info", "1", self._observe_cache_config)
        gauge("tgi_paged_preempted_max_wait_seconds", "s", self._observe_max_wait)
        for name, field in (
            ("tgi_paged_device_memory_bytes", "device_total_bytes"),
            ("tgi_paged_weights_bytes", "weights_bytes"),
            ("tgi_paged_activation_peak_bytes", "activation_peak_bytes"),
            ("tgi_paged_kv_pool_bytes", "pool_bytes"),
            ("tgi_paged_swap_space_bytes", "swap_bytes"),
            ("tgi_paged_lora_weights_bytes", "lora_bytes"),
        ):
            gauge(name, "By", self._budget_field(field))

        self._preemptions = counter("tgi_paged_preemptions_total", "{preemption}")
        self._computed = counter("tgi_paged_computed_tokens_total", "{token}")
        self._recomputed = counter("tgi_paged_recomputed_tokens_total", "{token}")
        self._swap_bytes = counter("tgi_paged_swap_bytes_total", "By")
        self._prefix_hit = counter("tgi_paged_prefix_hit_tokens_total", "{token}")
        self._prefix_query = counter("tgi_paged_prefix_query_tokens_total", "{token}")
        self._image_tokens = counter("tgi_paged_image_tokens_total", "{token}")
        self._images_encoded = counter("tgi_paged_images_encoded_total", "{image}")
        self._preempted_wait = histogram("tgi_paged_preempted_wait_seconds", "s")
        self._step_seconds = histogram("tgi_paged_step_seconds", "s")
        self._step_part_seconds = histogram("tgi_paged_step_part_seconds", "s")
        self._batch_size = histogram("tgi_paged_batch_size", "{request}")
        self._grammar_compile = histogram("tgi_paged_grammar_compile_seconds", "s")
        self._grammar_hits = counter("tgi_paged_grammar_cache_hits_total", "{request}")
        self._constrained_rows = histogram("tgi_paged_constrained_rows", "{request}")
        self._spec_drafts = counter("tgi_paged_spec_draft_tokens_total", "{token}")
        self._spec_accepted = counter("tgi_paged_spec_accepted_tokens_total", "{token}")
        self._spec_totals = (0, 0)
        gauge("tgi_paged_spec_acceptance_ratio", "1", self._observe_acceptance)
        gauge("tgi_paged_lora_requests_info", "s", self._observe_lora_info)
        gauge("tgi_paged_lora_requests", "{request}", self._observe_lora_requests)
        self._lora_unknown = counter("tgi_paged_lora_unknown_adapter_requests_total", "{request}")
        self._lora_unknown.add(0)
        self._tiers = None
        for name, unit, callback in (
            ("tgi_paged_kv_tier_hit_tokens_total", "{token}", self._observe_tier_hits),
            ("tgi_paged_kv_tier_moved_bytes_total", "By", self._tier_moved(lambda t: t.moved_bytes)),
            ("tgi_paged_kv_tier_moved_seconds_total", "s", self._tier_moved(lambda t: t.moved_s)),
            ("tgi_paged_kv_tier_dropped_blocks_total", "{block}", self._observe_tier_dropped),
            ("tgi_paged_kv_tier_swap_kept_blocks_total", "{block}", self._observe_swap_kept),
        ):  # cumulative values the engine keeps: observable counters
            meter.create_observable_counter(name, callbacks=[callback], unit=unit, description=METRIC_NAMES[name])
        gauge("tgi_paged_kv_host_tier_rows", "{row}", self._observe_host_rows)
        gauge("tgi_paged_kv_disk_tier_files", "{file}", self._disk_field(lambda d: [(d.num_files, {})]))
        gauge(
            "tgi_paged_kv_disk_tier_bytes",
            "By",
            self._disk_field(lambda d: [(d.num_bytes, {"state": "used"}), (d.max_bytes, {"state": "max"})]),
        )
        # Zero-valued series for every label value, so rate() and dashboards see them from the start.
        for attrs in self._mode_attrs.values():
            self._preemptions.add(0, attrs)
        for attrs in self._direction_attrs.values():
            self._swap_bytes.add(0, attrs)
        for instrument in (
            self._computed,
            self._recomputed,
            self._prefix_hit,
            self._prefix_query,
            self._image_tokens,
            self._images_encoded,
            self._spec_drafts,
            self._spec_accepted,
        ):
            instrument.add(0)

    def _observe_acceptance(self, options: CallbackOptions) -> list[Observation]:
        drafted, accepted = self._spec_totals
        return [Observation(accepted / drafted if drafted else 0.0)]

    def _pool(self, value):
        def callback(options: CallbackOptions) -> list[Observation]:
            memory = self._memory
            return [] if memory is None else [Observation(value(memory))]

        return callback

    def _observe_blocks(self, options: CallbackOptions) -> list[Observation]:
        m = self._memory
        if m is None:
            return []
        return [
            Observation(m.num_free_blocks, {"state": "free"}),
            Observation(m.num_used_blocks, {"state": "used"}),
            Observation(m.num_retained_blocks, {"state": "retained"}),
            Observation(m.num_swapped_blocks, {"state": "swapped"}),
        ]

    def _observe_groups(self, options: CallbackOptions) -> list[Observation]:
        m = self._memory
        if m is None:
            return []
        observations = []
        for g, (window, held, holes) in enumerate(zip(m.group_windows, m.group_blocks, m.group_hole_blocks)):
            labels = {"group": str(g), "window": "full" if window is None else str(window)}
            observations.append(Observation(held, {**labels, "state": "held"}))
            observations.append(Observation(holes, {**labels, "state": "reclaimed"}))
        return observations

    def _observe_group_waste(self, options: CallbackOptions) -> list[Observation]:
        m = self._memory
        if m is None or not m.group_internal_waste_slots:
            return []
        return [
            Observation(m.group_internal_waste_ratio(g), {"group": str(g), "window": "full" if w is None else str(w)})
            for g, w in enumerate(m.group_windows)
        ]

    def _observe_waste(self, options: CallbackOptions) -> list[Observation]:
        m = self._memory
        if m is None:
            return []
        return [
            Observation(m.internal_waste_ratio, {"kind": "internal"}),
            Observation(m.reservation_waste_ratio, {"kind": "reservation"}),
            Observation(m.external_waste_ratio, {"kind": "external"}),
        ]

    def _observe_requests(self, options: CallbackOptions) -> list[Observation]:
        running, preempted, _, waiting = self._requests
        return [
            Observation(running, {"state": "running"}),
            Observation(preempted, {"state": "preempted"}),
            Observation(waiting, {"state": "waiting"}),
        ]

    def _observe_lora_info(self, options: CallbackOptions) -> list[Observation]:
        usage = self._lora
        labels = {
            "max_lora": str(usage.max_loras),
            "running_lora_adapters": ",".join(usage.running_adapters),
            "waiting_lora_adapters": ",".join(usage.waiting_adapters),
        }
        return [Observation(usage.updated_at, labels)]

    def _observe_lora_requests(self, options: CallbackOptions) -> list[Observation]:
        usage = self._lora
        return [
            Observation(n, {"adapter": name, "state": state})
            for state, counts in (("running", usage.running), ("waiting", usage.waiting))
            for name, n in counts.items()
        ]

    def _observe_queued(self, options: CallbackOptions) -> list[Observation]:
        _, preempted, _, waiting = self._requests
        return [Observation(preempted + waiting)]

    def _observe_cache_config(self, options: CallbackOptions) -> list[Observation]:
        m = self._memory
        if m is None:
            return []
        return [Observation(1, {"block_size": str(m.block_size), "num_gpu_blocks": str(m.num_total_blocks)})]

    def _observe_max_wait(self, options: CallbackOptions) -> list[Observation]:
        return [Observation(self._requests[2])]

    def _observe_tier_hits(self, options: CallbackOptions) -> list[Observation]:
        t = self._tiers
        return [] if t is None else [Observation(t.hit_tokens[tier], {"tier": tier}) for tier in TIERS]

    def _tier_moved(self, values):
        def callback(options: CallbackOptions) -> list[Observation]:
            t = self._tiers
            if t is None:
                return []
            moved = values(t)
            return [Observation(moved[d], {"direction": d}) for d in TIER_DIRECTIONS]

        return callback

    def _observe_swap_kept(self, options: CallbackOptions) -> list[Observation]:
        t = self._tiers
        return [] if t is None else [Observation(t.swap_kept_blocks, {})]

    def _observe_tier_dropped(self, options: CallbackOptions) -> list[Observation]:
        t = self._tiers
        if t is None:
            return []
        out = [
            Observation(t.host_evicted_blocks, {"tier": "host", "reason": "evicted"}),
            Observation(t.host_lost_blocks, {"tier": "host", "reason": "no_room"}),
        ]
        d = t.disk
        if d is not None:
            for reason, value in (
                ("evicted", d.evicted_files),
                ("ignored", d.ignored_files),
                ("write_error", d.write_errors),
                ("queue_full", d.dropped_writes),
            ):
                out.append(Observation(value, {"tier": "disk", "reason": reason}))
        return out

    def _observe_host_rows(self, options: CallbackOptions) -> list[Observation]:
        t = self._tiers
        if t is None:
            return []
        return [Observation(t.host_rows_used, {"state": "used"}), Observation(t.host_rows_total, {"state": "total"})]

    def _disk_field(self, values):
        def callback(options: CallbackOptions) -> list[Observation]:
            t = self._tiers
            if t is None or t.disk is None:
                return []
            return [Observation(value, attrs) for value, attrs in values(t.disk)]

        return callback

    def _budget_field(self, field: str):
        def callback(options: CallbackOptions) -> list[Observation]:
            budget = self._budget
            return [] if budget is None else [Observation(getattr(budget, field))]

        return callback


def views() -> list[View]:
    def buckets(name: str, bounds: tuple[float, ...]) -> View:
        return View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(boundaries=bounds))

    return [
        buckets("tgi_paged_step_seconds", STEP_SECONDS_BUCKETS),
        buckets("tgi_paged_step_part_seconds", STEP_PART_SECONDS_BUCKETS),
        buckets("tgi_paged_preempted_wait_seconds", WAIT_SECONDS_BUCKETS),
        buckets("tgi_paged_batch_size", BATCH_SIZE_BUCKETS),
        buckets("tgi_paged_grammar_compile_seconds", COMPILE_SECONDS_BUCKETS),
        buckets("tgi_paged_constrained_rows", BATCH_SIZE_BUCKETS),
    ]
