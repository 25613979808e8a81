"""The order of one peer comparison: HF reference, this shard, the bare forward, vLLM, transformers CB.

Every engine gets the same job (``jobs.build_job``); an engine that cannot run (no peer venv, an old
transformers, a crash) is reported as skipped with the reason, and the others still run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from integration.bench_e2e import build_prompts, cpu_probe_ms
from integration.peers.jobs import (
    EngineResult,
    build_job,
    figures,
    peer_traces,
    prompt_ids,
    python_env,
    run_worker,
    this_python,
)

HERE = Path(__file__).resolve().parent
DEFAULT_PEERS = Path.home() / ".cache" / "tgi-paged-backend" / "peers"


@dataclass(frozen=True, slots=True, kw_only=True)
class PeersConfig:
    model_dir: Path
    requests: int = 32
    rate: float = 1.0
    """Poisson arrivals, requests per second."""
    threads: int = 2
    kv_tokens: int = 4096
    block_size: int = 16
    max_batch_tokens: int = 1024
    """Prefill token budget per step, the same for every engine."""
    seed: int = 0
    engines: tuple[str, ...] = ("shard", "vllm", "transformers")
    vllm_python: Path = DEFAULT_PEERS / "vllm" / "bin" / "python"
    worker_timeout_s: float = 900.0
    cache_dir: Path = Path("out/bench")
    """Where the HF reference tokens are cached between runs (``--out``)."""


def run_all(cfg: PeersConfig, *, log=print) -> dict[str, Any]:
    import transformers

    from integration.peers.shard_run import run_shard

    t0 = time.perf_counter()
    traces = peer_traces(cfg.requests, cfg.rate, cfg.seed)
    burst = traces["burst"]
    tok = transformers.AutoTokenizer.from_pretrained(cfg.model_dir)
    prompts = build_prompts(tok, burst, cfg.seed)
    ids = prompt_ids(tok, prompts)
    max_new = max(r.max_new_tokens for r in burst)
    max_model_len = max(256, max(len(i) for i in ids)) + max_new
    job = build_job(
        model_dir=cfg.model_dir,
        traces=traces,
        ids=ids,
        threads=cfg.threads,
        kv_tokens=cfg.kv_tokens,
        block_size=cfg.block_size,
        max_batch_tokens=cfg.max_batch_tokens,
        max_model_len=max_model_len,
    )
    env = python_env(cfg.threads)
    load = (os.getloadavg()[0], cpu_probe_ms())
    reference = _reference(cfg, job, env, log)
    results: list[EngineResult] = []
    shape = {"batch": min(cfg.requests, 32), "context": int(np.mean([len(i) for i in ids]) + max_new / 2)}

    def add(result: EngineResult, runs: dict[str, list[dict]]) -> None:
        for name, requests in runs.items():
            result.runs[name] = figures(requests, traces[name], reference)
        # The machine is shared: the load during each engine's slot, so uneven load shows.
        result.notes.append(
            f"load average {slot['load']:.1f} -> {os.getloadavg()[0]:.1f}, cpu probe "
            f"{slot['probe']:.0f} -> {cpu_probe_ms():.0f} ms"
        )
        results.append(result)

    def start_slot() -> None:
        slot.update(load=os.getloadavg()[0], probe=cpu_probe_ms())

    slot: dict[str, float] = {}

    if "shard" in cfg.engines:
        log("this shard ...")
        start_slot()
        try:
            shard, runs, measured = run_shard(job, prompts, max_batch_prefill_tokens=cfg.max_batch_tokens, log=log)
            shape.update(measured)
            add(shard, runs)
        except Exception as err:  # report-only: show the reason, go on with the others
            results.append(EngineResult(engine="this shard", skipped=f"{type(err).__name__}: {err}"))
    log(f"bare forward ({shape['batch']} rows x {shape['context']} tokens) ...")
    bare = run_worker(
        this_python(),
        HERE / "hf_worker.py",
        {**job, "bare": shape},
        "bare",
        env=env,
        timeout_s=cfg.worker_timeout_s,
        log=log,
    )
    if "vllm" in cfg.engines:
        log("vLLM CPU build ...")
        start_slot()
        add(
            *_worker_engine(
                "vllm",
                cfg.vllm_python,
                "vllm_worker.py",
                "serve",
                job,
                env,
                cfg,
                log,
                missing="no peer venv: run scripts/build_peer_venvs.sh",
            )
        )
    if "transformers" in cfg.engines:
        log("transformers continuous batching ...")
        start_slot()
        add(
            *_worker_engine(
                "transformers continuous batching",
                Path(this_python()),
                "hf_worker.py",
                "cb",
                job,
                env,
                cfg,
                log,
                missing="",
            )
        )
    config = {
        "requests": cfg.requests,
        "rate": cfg.rate,
        "threads": cfg.threads,
        "kv_tokens": cfg.kv_tokens,
        "block_size": cfg.block_size,
        "max_batch_tokens": cfg.max_batch_tokens,
        "model": cfg.model_dir.name,
        "prompt_min": min(len(i) for i in ids),
        "prompt_max": max(len(i) for i in ids),
        "prompt_mean": float(np.mean([len(i) for i in ids])),
        "output_min": min(r.output_tokens for r in burst),
        "output_max": max(r.output_tokens for r in burst),
        "output_mean": float(np.mean([r.output_tokens for r in burst])),
        "useful_tokens": sum(r.output_tokens for r in burst),
    }
    machine = (
        f"{os.cpu_count()} CPUs; load average {load[0]:.1f} -> {os.getloadavg()[0]:.1f}; cpu probe "
        f"{load[1]:.0f} ms before, {cpu_probe_ms():.0f} ms after (fixed single-thread matmul loop; higher = busier)"
    )
    return {
        "config": config,
        "results": results,
        "bare": bare,
        "shape": shape,
        "machine": machine,
        "elapsed_s": time.perf_counter() - t0,
    }


def _reference(cfg: PeersConfig, job: dict, env: dict, log) -> list[list[int]]:
    """HF greedy tokens, cached in ``cfg.cache_dir`` by the job's prompts, lengths, model and threads
    (one request at a time: minutes on 2 busy cores, and the same for every run of the same trace)."""
    key_src = json.dumps(
        [str(cfg.model_dir), job["threads"], [(r["prompt_ids"], r["output_tokens"]) for r in job["runs"]["burst"]]]
    )
    path = cfg.cache_dir / f"peers_reference_{hashlib.sha256(key_src.encode()).hexdigest()[:16]}.json"
    if path.exists():
        log(f"HF greedy reference: cached ({path})")
        return json.loads(path.read_text())["tokens"]
    log("HF greedy reference ...")
    tokens = run_worker(
        this_python(), HERE / "hf_worker.py", job, "reference", env=env, timeout_s=cfg.worker_timeout_s, log=log
    )["tokens"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"tokens": tokens}))
    return tokens


def _worker_engine(
    label: str, python: Path, worker: str, mode: str, job: dict, env: dict, cfg: PeersConfig, log, *, missing: str
) -> tuple[EngineResult, dict[str, list[dict]]]:
    """``(result, raw runs)``; a skipped result (with the reason) and no runs when it could not run."""
    if not python.exists():
        return EngineResult(engine=label, skipped=missing or f"{python} not found"), {}
    try:
        out = run_worker(str(python), HERE / worker, job, mode, env=env, timeout_s=cfg.worker_timeout_s, log=log)
    except Exception as err:  # report-only
        return EngineResult(engine=label, skipped=f"{type(err).__name__}: {str(err)[-600:]}"), {}
    if "skipped" in out:
        return EngineResult(engine=label, skipped=out["skipped"]), {}
    return EngineResult(
        engine=out["engine"], peak_rss_bytes=out["peak_rss_bytes"], setup_s=out["setup_s"], notes=out.get("notes", [])
    ), out["runs"]
