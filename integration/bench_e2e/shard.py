"""A shard mode: the shard spawned as the launcher does, the trace replayed through the router, scraped."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from integration.bench_e2e.results import E2EConfig, ModeResult, RequestRecord, cpu_probe_ms
from integration.bench_e2e.shard_figures import shard_result
from integration.net import free_port
from integration.prometheus_text import Samples, sample_value, scrape, scrape_every


def shard_env(cfg: E2EConfig, overcommit: float, metrics_port: int) -> dict[str, str]:
    env = {
        "TGI_PAGED_BLOCK_SIZE": str(cfg.block_size),
        "TGI_PAGED_OVERCOMMIT": f"{overcommit:g}",
        "TGI_PAGED_METRICS_PORT": str(metrics_port),
        "PREFIX_CACHING": "0",
        # The launcher clears the environment: keep this interpreter's bin dir (the entry point).
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    if cfg.num_blocks is not None:
        env["TGI_PAGED_NUM_BLOCKS"] = str(cfg.num_blocks)
    if cfg.threads:
        env["OMP_NUM_THREADS"] = str(cfg.threads)
    env.update(dict(cfg.extra_env))
    return env


async def _drive(router: Any, cfg: E2EConfig, prompts: Sequence[str], port: int) -> tuple[list[RequestRecord], dict]:
    from integration.router_replay import GenerateParameters, TokenEvent

    t0 = time.perf_counter()
    records = [RequestRecord(i, 0, r.output_tokens, r.arrival) for i, r in enumerate(cfg.trace)]
    live = {"submitted": 0, "done": 0}
    samples: dict[str, list[float]] = {
        k: []
        for k in (
            "t",
            "running",
            "preempted",
            "waiting",
            "queued",
            "queue_blocked_on_kv",
            "used_blocks",
            "free_blocks",
            "retained_blocks",
            "pool_tokens",
            "reserved_tokens",
            "internal_ratio",
            "reservation_ratio",
            "external_ratio",
        )
    }

    async def one(rec: RequestRecord) -> None:
        await asyncio.sleep(max(0.0, rec.arrival - (time.perf_counter() - t0)))
        live["submitted"] += 1
        params = GenerateParameters(max_new_tokens=cfg.trace[rec.idx].max_new_tokens, ignore_eos_token=True)
        stream = await router.generate(prompts[rec.idx], params)
        rec.input_length = stream.input_length
        try:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    rec.token_times.append(time.perf_counter() - t0)
                    if len(rec.token_times) >= rec.output_tokens:
                        break
        finally:
            await stream.aclose()
            live["done"] += 1

    def take(m: Samples) -> None:
        samples["t"].append(time.perf_counter() - t0)
        samples["running"].append(sample_value(m, "tgi_paged_requests", state="running"))
        samples["preempted"].append(sample_value(m, "tgi_paged_requests", state="preempted"))
        samples["waiting"].append(sample_value(m, "tgi_paged_requests", state="waiting"))
        stats = router.stats
        samples["queued"].append(float(stats.queue_length))
        samples["queue_blocked_on_kv"].append(float(stats.queue_blocked_on_kv))
        for state in ("used", "free", "retained"):
            samples[f"{state}_blocks"].append(sample_value(m, "tgi_paged_kv_blocks", state=state))
        samples["pool_tokens"].append(sample_value(m, "tgi_paged_kv_physical_tokens"))
        samples["reserved_tokens"].append(sample_value(m, "tgi_paged_kv_virtual_reserved_tokens"))
        for kind in ("internal", "reservation", "external"):
            samples[f"{kind}_ratio"].append(sample_value(m, "tgi_paged_kv_waste_ratio", kind=kind))

    sampling = asyncio.create_task(scrape_every(port, cfg.scrape_interval_s, take))
    try:
        await asyncio.gather(*(one(r) for r in records))
    finally:
        sampling.cancel()
    return records, samples


def run_shard_mode(cfg: E2EConfig, prompts: Sequence[str], overcommit: float, *, mode: str, log=print) -> ModeResult:
    """Spawn the shard with ``overcommit``, replay the trace through the router, scrape its metrics."""
    from integration.launcher_spawn import LaunchedShards, LauncherOptions
    from integration.router_replay import Router

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tgi-bench-") as tmp:
        opts = LauncherOptions(
            uds_path=str(Path(tmp) / "shard"),
            log_level="INFO",
            env=shard_env(cfg, overcommit, port),
            max_input_tokens=cfg.max_input_tokens,
            max_total_tokens=cfg.max_total_tokens,
        )
        t_setup = time.perf_counter()
        with LaunchedShards(str(cfg.model_dir), opts, ready_timeout=cfg.ready_timeout_s) as shards:

            async def scenario() -> tuple[list[RequestRecord], dict, dict, Any, float]:
                router = await Router.connect(
                    opts.uds_path,
                    str(cfg.model_dir),
                    max_input_tokens=cfg.max_input_tokens,
                    max_total_tokens=cfg.max_total_tokens,
                    max_batch_prefill_tokens=cfg.max_batch_prefill_tokens,
                )
                try:
                    # One short request first, so lazy initialisation is not timed.
                    warm = await router.generate("warm up", _params(2))
                    await warm.collect()
                    before = await asyncio.to_thread(scrape, port)
                    load = (os.getloadavg()[0], cpu_probe_ms())
                    setup = time.perf_counter() - t_setup
                    records, samples = await _drive(router, cfg, prompts, port)
                    await asyncio.sleep(0.3)  # let the last FilterBatch land before the final scrape
                    after = await asyncio.to_thread(scrape, port)
                    return records, samples, {"before": before, "after": after, "load": load}, router.stats, setup
                finally:
                    await router.close(raise_fatal=False)

            records, samples, counters, stats, setup_s = asyncio.run(scenario())
            info_line = next((r.text for r in shards.logs if "warmup:" in r.text), "")
        log(f"  {mode} (overcommit {overcommit:g}): {info_line}")
    return shard_result(cfg, mode, overcommit, records, samples, counters, stats, setup_s)


def _params(n: int):
    from integration.router_replay import GenerateParameters

    return GenerateParameters(max_new_tokens=n, ignore_eos_token=True)
