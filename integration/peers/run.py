"""The order of one peer comparison: per section (SmolLM2, the host-bound model), the HF reference, the
engines in alternated rounds (:mod:`integration.peers.plan`), then the bare forward.

Every engine gets the same job (``jobs.build_job``) in the same ``--dtype``; an engine that cannot run (no peer
venv, an old transformers, a crash) is reported as skipped with the reason, and the others still run.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from integration.bench_e2e import build_prompts, cpu_probe_ms
from integration.peers.host import host_info
from integration.peers.hostbound import HostBoundSpec, ensure_hostbound_model
from integration.peers.jobs import (
    EngineResult,
    build_job,
    figures,
    peer_traces,
    prefill_trace,
    prompt_ids,
    python_env,
    run_worker,
    single_trace,
    this_python,
)
from integration.peers.plan import SCENARIOS, Section, merge_rounds, schedule, sections

HERE = Path(__file__).resolve().parent
DEFAULT_PEERS = Path.home() / ".cache" / "tgi-paged-backend" / "peers"
ENGINE_LABELS = {"shard": "this shard", "vllm": "vLLM CPU build", "transformers": "transformers continuous batching"}


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
    dtype: str = "float32"
    """Weights and activations of every engine (and of the HF reference and bare forward)."""
    repeats: int = 2
    """Alternated rounds of this shard and vLLM (``plan.schedule``); the best round is reported."""
    scenarios: tuple[str, ...] = SCENARIOS
    hostbound: HostBoundSpec = field(default_factory=HostBoundSpec)
    """The host-bound shape and seed; its ``form`` is set per section from ``hostbound_forms``."""
    hostbound_forms: tuple[str, ...] = ("llama",)
    """Layer forms of the host-bound model, a section each (:data:`integration.peers.hostbound_forms.FORMS`)."""
    models: tuple[Path, ...] = ()
    """More model directories, a burst section each (their own tokenizer)."""
    hostbound_check: int = 8
    """Requests of the host-bound burst compared with HF greedy (random weights: near-ties; 0 skips it)."""
    vllm_python: Path = DEFAULT_PEERS / "vllm" / "bin" / "python"
    worker_timeout_s: float = 900.0
    cache_dir: Path = Path("out/bench")
    """Where the HF reference tokens and the host-bound checkpoint are kept between runs (``--out``)."""


def run_all(cfg: PeersConfig, *, log=print) -> dict[str, Any]:
    import transformers

    t0 = time.perf_counter()
    host = host_info()
    load = (os.getloadavg()[0], cpu_probe_ms())
    tok = transformers.AutoTokenizer.from_pretrained(cfg.model_dir)
    out = []
    for section in sections(cfg.scenarios, cfg.hostbound_forms, [str(m) for m in cfg.models]):
        if section.hostbound:
            spec = replace(cfg.hostbound, form=section.form)
            model_dir = ensure_hostbound_model(cfg.cache_dir, cfg.model_dir, spec, log=log)
        elif section.model_dir:
            model_dir = Path(section.model_dir)
        else:
            model_dir = cfg.model_dir
        own = transformers.AutoTokenizer.from_pretrained(model_dir) if section.model_dir else tok
        out.append(run_section(cfg, section, model_dir, own, log=log))
    machine = (
        f"{os.cpu_count()} CPUs; load average {load[0]:.1f} -> {os.getloadavg()[0]:.1f}; cpu probe "
        f"{load[1]:.0f} ms before, {cpu_probe_ms():.0f} ms after (fixed single-thread matmul loop; higher = busier)"
    )
    return {
        "host": host,
        "dtype": cfg.dtype,
        "repeats": cfg.repeats,
        "scenarios": list(cfg.scenarios),
        "sections": out,
        "machine": machine,
        "elapsed_s": time.perf_counter() - t0,
    }


def run_section(cfg: PeersConfig, section: Section, model_dir: Path, tok: Any, *, log=print) -> dict[str, Any]:
    """One model: its job, reference, engine rounds and bare forward; the dict ``report.section_report`` reads."""
    t0 = time.perf_counter()
    both = {**peer_traces(cfg.requests, cfg.rate, cfg.seed), "single": single_trace(), "prefill": prefill_trace()}
    traces = {name: both[name] for name in section.runs}
    # Same lengths and seed give the same texts: burst and Poisson serve the same prompts.
    prompts = {name: build_prompts(tok, trace, cfg.seed + (name == "single")) for name, trace in traces.items()}
    ids = {name: prompt_ids(tok, texts) for name, texts in prompts.items()}
    max_new = max(r.max_new_tokens for trace in traces.values() for r in trace)
    longest = max(len(i) for run in ids.values() for i in run)
    max_model_len = max(256, longest) + max_new
    job = build_job(
        model_dir=model_dir,
        dtype=cfg.dtype,
        traces=traces,
        prompts=prompts,
        ids=ids,
        threads=cfg.threads,
        kv_tokens=cfg.kv_tokens,
        block_size=cfg.block_size,
        # A prompt in one prefill step for every engine (the prefill run's prompts exceed the burst's budget).
        max_batch_tokens=max(cfg.max_batch_tokens, longest) if section.key == "prefill" else cfg.max_batch_tokens,
        max_model_len=max_model_len,
        sequential=section.key == "prefill",
    )
    env = python_env(cfg.threads)
    timings: list[tuple[str, float]] = []
    t = time.perf_counter()
    refs = _references(cfg, section, job, env, log)
    timings.append(("HF reference", time.perf_counter() - t))

    rounds: dict[str, list[EngineResult]] = {}
    burst = traces.get("burst") or next(iter(traces.values()))
    lengths = [len(i) for i in ids.get("burst", next(iter(ids.values())))]
    shape = {"batch": min(len(burst), 32), "context": int(np.mean(lengths) + max_new / 2)}
    engines = [e for e in cfg.engines if not (section.key == "prefill" and e == "transformers")]  # no sequential
    for slot in schedule(section.runs, engines, cfg.repeats):
        label = f"{ENGINE_LABELS[slot.engine]}, round {slot.round + 1} ({', '.join(slot.runs)})"
        log(f"[{section.key}] {label} ...")
        t, load, probe = time.perf_counter(), os.getloadavg()[0], cpu_probe_ms()
        result, raw, measured = _engine(
            slot.engine, {**job, "runs": {n: job["runs"][n] for n in slot.runs}}, cfg, env, log
        )
        if measured and slot.engine == "shard" and slot.round == 0:
            shape.update(measured)  # the bare forward's shape: the first round's burst
        for name, requests in raw.items():
            result.runs[name] = figures(requests, traces[name], refs.get(name))
        if not result.skipped:
            # The machine is shared: the load during each engine's slot, so uneven load shows.
            result.notes.append(
                f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}, cpu probe {probe:.0f} -> {cpu_probe_ms():.0f} ms"
            )
        rounds.setdefault(slot.engine, []).append(result)
        timings.append((label, time.perf_counter() - t))
    bare = None
    if "burst" in section.runs:
        log(f"[{section.key}] bare forward ({shape['batch']} rows x {shape['context']} tokens) ...")
        t = time.perf_counter()
        bare_job = {**job, "bare": {"batch": shape["batch"], "context": shape["context"]}}
        try:
            bare = run_worker(
                this_python(), HERE / "hf_worker.py", bare_job, "bare", env=env, timeout_s=cfg.worker_timeout_s, log=log
            )
        except Exception as err:  # report-only
            log(f"  bare forward failed: {type(err).__name__}: {str(err)[-300:]}")
        timings.append(("bare forward", time.perf_counter() - t))
    results = [merge_rounds(rounds[e]) for e in engines if e in rounds]
    return {
        "key": section.key,
        "config": _section_config(cfg, section, model_dir, traces, ids, refs),
        "results": results,
        "bare": bare,
        "shape": shape,
        "timings": timings,
        "elapsed_s": time.perf_counter() - t0,
    }


def _section_config(cfg, section, model_dir, traces, ids, refs) -> dict[str, Any]:
    burst = traces.get("burst") or traces.get("poisson") or []
    lengths = [len(i) for i in (ids.get("burst") or ids.get("poisson") or [])]
    config = {
        "section": section.key,
        "runs": list(section.runs),
        "model": model_dir.name,
        "dtype": cfg.dtype,
        "requests": len(burst),
        "rate": cfg.rate,
        "threads": cfg.threads,
        "kv_tokens": cfg.kv_tokens,
        "block_size": cfg.block_size,
        "max_batch_tokens": cfg.max_batch_tokens,
        "reference_compared": {name: len(ref) for name, ref in refs.items()},
    }
    if burst:
        config.update(
            prompt_min=min(lengths),
            prompt_max=max(lengths),
            prompt_mean=float(np.mean(lengths)),
            output_min=min(r.output_tokens for r in burst),
            output_max=max(r.output_tokens for r in burst),
            output_mean=float(np.mean([r.output_tokens for r in burst])),
            useful_tokens=sum(r.output_tokens for r in burst),
        )
    if "prefill" in traces:
        config["prefill_prompts"] = [len(i) for i in ids["prefill"]]
    if "single" in traces:
        config.update(single_prompt=len(ids["single"][0]), single_new=traces["single"][0].output_tokens)
    if section.hostbound:
        spec = replace(cfg.hostbound, form=section.form)
        config["hostbound"] = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
    return config


def _references(cfg: PeersConfig, section: Section, job: dict, env: dict, log) -> dict[str, list[list[int]]]:
    """HF greedy tokens per run name: the burst's prompts (also Poisson's), and the single request's.

    On the host-bound model only the first ``cfg.hostbound_check`` burst requests are compared (random weights).
    """
    runs = job["runs"]
    limit = cfg.hostbound_check if section.hostbound else None
    out: dict[str, list[list[int]]] = {}
    shared = runs.get("burst") or runs.get("poisson")
    if shared and limit != 0:
        tokens = _reference(cfg, job, shared[:limit], env, log)
        out.update({name: tokens for name in ("burst", "poisson") if name in runs})
    if "single" in runs:
        out["single"] = _reference(cfg, job, runs["single"], env, log)
    return out


def _reference(cfg: PeersConfig, job: dict, requests: list[dict], env: dict, log) -> list[list[int]]:
    """HF greedy tokens of ``requests``, cached in ``cfg.cache_dir`` by model, threads, dtype, prompts and lengths
    (one request at a time: minutes on 2 busy cores, and the same for every run of the same trace)."""
    key = [job["model_dir"], job["threads"], [(r["prompt_ids"], r["output_tokens"]) for r in requests]]
    if job["dtype"] != "float32":
        key.append(job["dtype"])  # float32 keys are those of earlier runs: their caches stay valid
    path = cfg.cache_dir / f"peers_reference_{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]}.json"
    if path.exists():
        log(f"  HF greedy reference ({len(requests)} requests): cached ({path})")
        return json.loads(path.read_text())["tokens"]
    log(f"  HF greedy reference ({len(requests)} requests) ...")
    ref_job = {
        **job,
        "reference": [{"prompt_ids": r["prompt_ids"], "output_tokens": r["output_tokens"]} for r in requests],
    }
    tokens = run_worker(
        this_python(), HERE / "hf_worker.py", ref_job, "reference", env=env, timeout_s=cfg.worker_timeout_s, log=log
    )["tokens"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"tokens": tokens}))
    return tokens


def _engine(engine: str, job: dict, cfg: PeersConfig, env: dict, log) -> tuple[EngineResult, dict, dict]:
    """``(result, raw runs, measured decode shape)``; a skipped result and no runs when it could not run."""
    if engine == "shard":
        from integration.peers.shard_run import run_shard

        try:
            return run_shard(job, max_batch_prefill_tokens=job["max_batch_tokens"], log=log)
        except Exception as err:  # report-only: show the reason, go on with the others
            return EngineResult(engine="this shard", key="shard", skipped=f"{type(err).__name__}: {err}"), {}, {}
    if engine == "vllm":
        missing = "no peer venv: run scripts/build_peer_venvs.sh"
        return *_worker_engine("vllm", cfg.vllm_python, "vllm_worker.py", "serve", job, env, cfg, log, missing), {}
    python = Path(this_python())
    return *_worker_engine("transformers", python, "hf_worker.py", "cb", job, env, cfg, log, ""), {}


def _worker_engine(
    key: str, python: Path, worker: str, mode: str, job: dict, env: dict, cfg: PeersConfig, log, missing: str
) -> tuple[EngineResult, dict[str, list[dict]]]:
    """``(result, raw runs)``; a skipped result (with the reason) and no runs when it could not run."""
    label = ENGINE_LABELS[key]
    if not python.exists():
        return EngineResult(engine=label, key=key, skipped=missing or f"{python} not found"), {}
    try:
        out = run_worker(str(python), HERE / worker, job, mode, env=env, timeout_s=cfg.worker_timeout_s, log=log)
    except Exception as err:  # report-only
        return EngineResult(engine=label, key=key, skipped=f"{type(err).__name__}: {str(err)[-600:]}"), {}
    if "skipped" in out:
        return EngineResult(engine=label, key=key, skipped=out["skipped"]), {}
    result = EngineResult(
        engine=out["engine"],
        key=out.get("key", key),
        peak_rss_bytes=out["peak_rss_bytes"],
        setup_s=out["setup_s"],
        notes=out.get("notes", []),
    )
    return result, out["runs"]
