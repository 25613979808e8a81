"""This shard on the peer job: spawned exactly as the TGI launcher does, driven by the v3 router replay.

One shard process serves every run of the job in order (burst, Poisson, the single request; ``--dtype`` the
job's). Clients send ``max_new_tokens``
= the trace's cap with ``ignore_eos_token`` and disconnect after ``output_tokens`` tokens (as in
``integration/bench_e2e/shard.py``). Around each run the shard's Prometheus endpoint is scraped for the step
anatomy of each run (``tgi_paged_step_part_seconds{phase="decode"}``, mean per decode step) and, every second,
for running requests and used blocks: the mean decode batch and context that the bare forward is
measured at. Peak memory is the shard process's ``VmHWM``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from integration.net import free_port
from integration.peers.jobs import EngineResult
from integration.prometheus_text import Samples, counter_delta, sample_value, scrape, scrape_every
from tgi_paged_backend.telemetry.step_record import STEP_PARTS


def shard_env(job: dict[str, Any], metrics_port: int) -> dict[str, str]:
    bs = int(job["block_size"])
    return {
        "TGI_PAGED_BLOCK_SIZE": str(bs),
        "TGI_PAGED_NUM_BLOCKS": str(job["kv_tokens"] // bs + 1),
        "TGI_PAGED_METRICS_PORT": str(metrics_port),
        "PREFIX_CACHING": "0",
        "OMP_NUM_THREADS": str(job["threads"]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }


def _vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def _drive(
    router: Any, requests: list[dict], port: int, *, block_size: int, max_new_tokens: int, sequential: bool = False
) -> tuple[list[dict], dict]:
    """Every request at its arrival time or, ``sequential``, each when the previous one has finished (its arrival then
    the time it was sent, and ``server_s`` the shard's prefill step seconds during it, from two scrapes)."""
    from integration.router_replay import GenerateParameters, TokenEvent

    t0 = time.perf_counter()
    results = [{"tokens": [], "arrival": r["arrival"], "token_times": []} for r in requests]
    samples: dict[str, list[float]] = {"running": [], "used_tokens": []}

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, requests[i]["arrival"] - (time.perf_counter() - t0)))
        params = GenerateParameters(max_new_tokens=max_new_tokens, ignore_eos_token=True)
        stream = await router.generate(requests[i]["prompt"], params)
        try:
            async for event in stream:
                if isinstance(event, TokenEvent):
                    results[i]["tokens"].append(event.id)
                    results[i]["token_times"].append(time.perf_counter() - t0)
                    if len(results[i]["tokens"]) >= requests[i]["output_tokens"]:
                        break
        finally:
            await stream.aclose()

    def take(m: Samples) -> None:
        running = sample_value(m, "tgi_paged_requests", state="running")
        if running > 0:
            samples["running"].append(running)
            samples["used_tokens"].append(sample_value(m, "tgi_paged_kv_blocks", state="used") * block_size)

    if sequential:
        for i in range(len(requests)):
            before = await asyncio.to_thread(scrape, port)
            results[i]["arrival"] = time.perf_counter() - t0
            await one(i)
            await asyncio.sleep(0.1)  # the step's histogram is recorded after its token went out
            after = await asyncio.to_thread(scrape, port)
            results[i]["server_s"] = counter_delta(before, after, "tgi_paged_step_seconds_sum", phase="prefill")
        return results, samples
    task = asyncio.create_task(scrape_every(port, 1.0, take))  # light: the router replay shares the CPU
    try:
        await asyncio.gather(*(one(i) for i in range(len(requests))))
    finally:
        task.cancel()
    return results, samples


def anatomy(before: dict, after: dict) -> tuple[dict[str, float], int]:
    """Mean seconds per decode step by part over the run (``step``: the whole step), the run's seconds in decode
    and prefill steps (``decode_total``, ``prefill_total``) and its prefill steps, and the number of decode steps."""

    def delta(name: str, **labels: str) -> float:
        return counter_delta(before, after, name, **labels)

    steps = int(delta("tgi_paged_step_seconds_count", phase="decode"))
    parts = {
        p: delta("tgi_paged_step_part_seconds_sum", phase="decode", part=p) / steps if steps else 0.0
        for p in STEP_PARTS
    }
    parts["step"] = delta("tgi_paged_step_seconds_sum", phase="decode") / steps if steps else 0.0
    parts["decode_total"] = delta("tgi_paged_step_seconds_sum", phase="decode")
    parts["prefill_total"] = delta("tgi_paged_step_seconds_sum", phase="prefill")
    parts["prefill_steps"] = delta("tgi_paged_step_seconds_count", phase="prefill")
    return parts, steps


MIN_CONTEXT_SAMPLES = 3
"""Metric samples a burst needs before its mean context is read from them."""


def _decode_shape(samples: dict[str, list[float]], tokens: int, requests: int, steps: int) -> dict[str, int]:
    """The burst's mean running batch and context. The batch comes from the counts (tokens after each request's
    first, per decode step): the metric samples (one a second) of a burst of a second or two fall on its tail,
    where few requests still run (host E's Qwen3 form printed "batch 1" against 16 from the counts). The context
    comes from the samples when at least :data:`MIN_CONTEXT_SAMPLES` were taken, else from the trace's estimate (the
    caller's: no key)."""
    shape = {"batch": max(1, round((tokens - requests) / steps))} if steps else {}
    n = len(samples["running"])
    if n >= MIN_CONTEXT_SAMPLES:
        ctx = sum(u / r for u, r in zip(samples["used_tokens"], samples["running"])) / n
        shape["context"] = max(1, round(ctx))
    return shape


def run_shard(
    job: dict[str, Any], *, max_batch_prefill_tokens: int, ready_timeout_s: float = 300, log=print
) -> tuple[EngineResult, dict[str, list[dict]], dict[str, float]]:
    """``(result shell, raw runs, decode shape {"batch", "context"} of the burst run)``."""
    from integration.launcher_spawn import LaunchedShards, LauncherOptions
    from integration.router_replay import Router

    port = free_port()
    max_input = job["max_model_len"] - job["max_new_tokens"]
    result = EngineResult(engine=f"this shard (launcher spawn + router replay, block {job['block_size']})", key="shard")
    with tempfile.TemporaryDirectory(prefix="tgi-peers-") as tmp:
        opts = LauncherOptions(
            uds_path=str(Path(tmp) / "shard"),
            log_level="INFO",
            env=shard_env(job, port),
            max_input_tokens=max_input,
            max_total_tokens=job["max_model_len"],
            dtype=job.get("dtype"),
        )
        t_setup = time.perf_counter()
        with LaunchedShards(job["model_dir"], opts, ready_timeout=ready_timeout_s) as shards:

            async def scenario():
                router = await Router.connect(
                    opts.uds_path,
                    job["model_dir"],
                    max_input_tokens=max_input,
                    max_total_tokens=job["max_model_len"],
                    max_batch_prefill_tokens=max_batch_prefill_tokens,
                )
                try:
                    warm = await router.generate("warm up", _params(2))
                    await warm.collect()
                    result.setup_s = time.perf_counter() - t_setup
                    runs, shapes = {}, {}
                    for name, requests in job["runs"].items():
                        before = await asyncio.to_thread(scrape, port)
                        runs[name], samples = await _drive(
                            router,
                            requests,
                            port,
                            block_size=job["block_size"],
                            max_new_tokens=job["max_new_tokens"],
                            sequential=bool(job.get("sequential")),
                        )
                        await asyncio.sleep(0.3)
                        after = await asyncio.to_thread(scrape, port)
                        parts, steps = anatomy(before, after)
                        result.anatomies[name] = {**parts, "decode_steps": steps}
                        tokens = sum(len(r["tokens"]) for r in runs[name])
                        if name == "burst":
                            result.anatomy = parts
                            shapes = {"decode_steps": steps, **_decode_shape(samples, tokens, len(requests), steps)}
                        log(f"  shard {name}: {tokens} tokens, {steps} decode steps")
                    return runs, shapes
                finally:
                    await router.close(raise_fatal=False)

            runs, shapes = asyncio.run(scenario())
            result.peak_rss_bytes = _vm_hwm(shards.pid(0))
            info = next((r.text for r in shards.logs if "warmup:" in r.text), "")
    result.notes.append(
        f"{job.get('dtype', 'float32')}, {job['threads']} threads (OMP_NUM_THREADS), max_batch_prefill_tokens "
        f"{max_batch_prefill_tokens}; {info.strip()}"
    )
    return result, runs, shapes


def _params(n: int):
    from integration.router_replay import GenerateParameters

    return GenerateParameters(max_new_tokens=n, ignore_eos_token=True)
