"""A shard mode's figures: its requests' token times and the scrapes of its Prometheus endpoint into a
:class:`ModeResult` (waste from the pool gauges, counters as deltas over the run)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from integration.bench_e2e.results import STOCK, E2EConfig, ModeResult, RequestRecord, client_figures, cpu_probe_ms
from integration.prometheus_text import counter_delta, sample_value


def shard_result(
    cfg: E2EConfig,
    mode: str,
    overcommit: float,
    records: list[RequestRecord],
    samples: dict,
    counters: dict,
    stats: Any,
    setup_s: float,
) -> ModeResult:
    before, after = counters["before"], counters["after"]

    def delta(name: str, **labels: str) -> float:
        return counter_delta(before, after, name, **labels)

    preemptions = {m: int(delta("tgi_paged_preemptions_total", mode=m)) for m in ("recompute", "swap")}
    recomputed = int(delta("tgi_paged_recomputed_tokens_total"))
    computed_counter = int(delta("tgi_paged_computed_tokens_total"))
    batch_sum, batch_count = delta("tgi_paged_batch_size_sum"), delta("tgi_paged_batch_size_count")
    received = sum(len(r.token_times) for r in records)
    # The shard's own counter when it has one; else prompt + generated (+1 for the token a disconnect
    # costs) + recomputed, counted client-side.
    computed = computed_counter or sum(r.input_length for r in records) + received + len(records) + recomputed
    # Waste from the gauges, in slots of the physical pool, averaged over samples with live work.
    bs = cfg.block_size
    pool_tokens = int(sample_value(after, "tgi_paged_kv_physical_tokens"))
    acc = {"internal": [], "reservation": [], "external": [], "idle_queued": [], "virtual": [], "used": []}
    gauges: dict[str, list[float]] = {"internal": [], "reservation": [], "external": []}
    for k in range(len(samples["t"])):
        running, preempted, queued = samples["running"][k], samples["preempted"][k], samples["queued"][k]
        pool = samples["pool_tokens"][k] or pool_tokens
        if running + preempted == 0 and queued == 0:
            continue
        used_slots = samples["used_blocks"][k] * bs
        internal = samples["internal_ratio"][k] * used_slots
        reservation = samples["reservation_ratio"][k] * samples["reserved_tokens"][k]
        free_slots = (samples["free_blocks"][k] + samples["retained_blocks"][k]) * bs
        memory_blocked = preempted > 0 or samples["waiting"][k] > 0 or samples["queue_blocked_on_kv"][k] > 0
        if mode == STOCK:
            # Stock TGI backs every reserved slot: idle memory is what no reservation holds.
            idle = max(pool - samples["reserved_tokens"][k], 0) / pool
            acc["reservation"].append(reservation / pool)
            acc["virtual"].append(0.0)
        else:
            idle = free_slots / pool
            acc["reservation"].append(0.0)
            acc["virtual"].append(reservation / pool)
        acc["external"].append(idle if memory_blocked else 0.0)
        acc["idle_queued"].append(idle if queued > 0 and not memory_blocked else 0.0)
        acc["internal"].append(internal / pool)
        acc["used"].append(max(used_slots - internal, 0) / pool)
        for kind in gauges:
            gauges[kind].append(samples[f"{kind}_ratio"][k])
    mean = {k: float(np.mean(v)) if v else 0.0 for k, v in acc.items()}
    peak_running = int(max(samples["running"], default=0))
    notes = [
        f"router admitted peak {stats.concurrency_peak}, queue peak {stats.queue_peak}; "
        f"{len(samples['t'])} metric scrapes",
        f"load average {counters['load'][0]:.1f} -> {os.getloadavg()[0]:.1f}; cpu probe "
        f"{counters['load'][1]:.0f} ms before, {cpu_probe_ms():.0f} ms after",
    ]
    return ModeResult(
        mode=mode,
        overcommit=overcommit,
        **client_figures(records),
        peak_admitted=int(stats.concurrency_peak),
        peak_running=peak_running,
        mean_batch=batch_sum / batch_count if batch_count else 0.0,
        preemptions=preemptions,
        recomputed_tokens=recomputed,
        computed_tokens=int(computed),
        waste_internal=mean["internal"],
        waste_reservation=mean["reservation"],
        waste_external=mean["external"],
        idle_queued=mean["idle_queued"],
        virtual_unbacked=mean["virtual"],
        kv_used=mean["used"],
        setup_s=setup_s,
        pool_tokens=pool_tokens,
        shard_waste={k: float(np.mean(v)) if v else 0.0 for k, v in gauges.items()},
        notes=notes,
        samples={k: samples[k] for k in ("t", "running", "preempted", "waiting", "queued", "queue_blocked_on_kv")},
    )
