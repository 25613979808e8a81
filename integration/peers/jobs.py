"""The shared trace and the JSON job each engine worker reads; the results it writes back.

A job is ``{"model_dir", "dtype", "threads", "max_new_tokens", "kv_tokens", "block_size", "max_batch_tokens",
"max_model_len", "sequential", "runs": {"burst": [...], "poisson": [...], "single": [...], "prefill": [...]}}`` (any
subset of the runs; ``sequential``: each request is sent when the previous one has finished, its ``arrival``
then the time it was sent) where each
request is ``{"prompt", "prompt_ids", "output_tokens", "arrival"}`` (the text for the shard's router, the ids for
the others). A worker answers ``{"engine", "runs": {name: [{"tokens", "arrival", "token_times"}]},
"peak_rss_bytes", "setup_s", "notes"}``: times are seconds after that run's start, ``token_times`` one
per generated token. Plain dicts and lists, so the vLLM worker (another venv, no tgi_paged_backend)
reads and writes them with ``json`` alone.
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tgi_paged_backend.planning.workload import LengthDist, TraceRequest, WorkloadSpec, generate_trace

PEERS_WORKLOAD = WorkloadSpec("peers", LengthDist(80.0, 0.6, 16, 200), LengthDist(56.0, 0.6, 16, 128), 128)
"""Prompts 16-200 tokens (mean 80), answers 16-128 (mean 56), clients cap at 128 new tokens."""


def peer_traces(num_requests: int, rate: float, seed: int = 0) -> dict[str, list[TraceRequest]]:
    """The same lengths twice: all at once (``burst``) and Poisson arrivals at ``rate`` requests/s."""
    burst = generate_trace(PEERS_WORKLOAD, num_requests, arrival="burst", seed=seed)
    poisson = generate_trace(PEERS_WORKLOAD, num_requests, arrival="poisson", rate=rate, seed=seed)
    # Same seed, same draw order: lengths agree; only the arrivals differ.
    poisson = [
        TraceRequest(b.prompt_tokens, b.output_tokens, p.arrival, b.max_new_tokens) for b, p in zip(burst, poisson)
    ]
    return {"burst": burst, "poisson": poisson}


SINGLE_PROMPT_TOKENS = 64
SINGLE_NEW_TOKENS = 128


def single_trace() -> list[TraceRequest]:
    """One request alone: a 64-token prompt, 128 new tokens (EOS ignored): the per-token latency figure."""
    return [TraceRequest(SINGLE_PROMPT_TOKENS, SINGLE_NEW_TOKENS, 0.0, SINGLE_NEW_TOKENS)]


PREFILL_LENGTHS = (128, 512, 1024, 2048)
"""Prompt lengths of the ``prefill`` run: one request at a time, one new token (time to first token)."""


def prefill_trace(lengths: Sequence[int] = PREFILL_LENGTHS) -> list[TraceRequest]:
    """One request per prompt length, each sent after the previous one answered, one new token each."""
    return [TraceRequest(n, 1, 0.0, 1) for n in lengths]


def prompt_ids(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """What the router counts and the shard computes: the text tokenized with special tokens."""
    return [tokenizer.encode(p, add_special_tokens=True) for p in prompts]


def build_job(
    *,
    model_dir: Path,
    dtype: str,
    traces: dict[str, list[TraceRequest]],
    prompts: dict[str, list[str]],
    ids: dict[str, list[list[int]]],
    threads: int,
    kv_tokens: int,
    block_size: int,
    max_batch_tokens: int,
    max_model_len: int,
    sequential: bool = False,
) -> dict[str, Any]:
    """``traces``, ``prompts`` and ``ids`` are keyed by run name, one entry per request of that run."""
    runs = {
        name: [
            {
                "prompt": prompts[name][i],
                "prompt_ids": ids[name][i],
                "output_tokens": r.output_tokens,
                "arrival": r.arrival,
            }
            for i, r in enumerate(trace)
        ]
        for name, trace in traces.items()
    }
    max_new = max(r.max_new_tokens for trace in traces.values() for r in trace)
    return {
        "model_dir": str(model_dir),
        "dtype": dtype,
        "threads": threads,
        "max_new_tokens": max_new,
        "kv_tokens": kv_tokens,
        "block_size": block_size,
        "max_batch_tokens": max_batch_tokens,
        "max_model_len": max_model_len,
        "sequential": sequential,
        "runs": runs,
    }


def run_worker(
    python: str, module_file: Path, job: dict[str, Any], mode: str, *, env: dict[str, str], timeout_s: float, log=print
) -> dict[str, Any]:
    """Run ``python module_file mode job.json out.json`` and read its answer (raises with its stderr tail)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tgi-peers-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        t0 = time.perf_counter()
        proc = subprocess.run(
            [python, str(module_file), mode, str(job_path), str(out_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0 or not out_path.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-25:])
            raise RuntimeError(f"{module_file.name} {mode} exited {proc.returncode}:\n{tail}")
        log(f"  {module_file.name} {mode}: {time.perf_counter() - t0:.0f} s")
        return json.loads(out_path.read_text())


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else math.nan


@dataclass(slots=True)
class RunFigures:
    """One engine on one arrival pattern."""

    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    wall_s: float
    itl_mean_s: float = math.nan
    """Mean gap between consecutive tokens of a request, over every request: decode seconds per token."""
    matched: int | None = None
    """Requests whose greedy tokens equal HF's (``None``: not compared)."""
    compared: int = 0
    first_mismatch: str = ""
    ttft_each_s: list[float] = field(default_factory=list)
    """Every request's time to first token, in request order (the ``prefill`` run reports them by length)."""
    server_each_s: list[float] = field(default_factory=list)
    """This shard only, sequential runs: the prefill steps' seconds each request took in the shard (from its
    Prometheus step histogram); TTFT minus this is the router replay, gRPC and the client."""


def figures(
    requests: Sequence[dict[str, Any]], trace: Sequence[TraceRequest], reference: Sequence[Sequence[int]] | None = None
) -> RunFigures:
    """Useful tokens (each request's ``output_tokens``) over first arrival -> last token.

    ``reference`` may be shorter than ``requests``: only its first requests are compared (``compared`` says how many).
    """
    ttft = [r["token_times"][0] - r["arrival"] for r in requests if r["token_times"]]
    itl = [b - a for r in requests for a, b in zip(r["token_times"], r["token_times"][1:])]
    last = max((r["token_times"][-1] for r in requests if r["token_times"]), default=math.nan)
    wall = last - min(t.arrival for t in trace)
    useful = sum(t.output_tokens for t in trace)
    out = RunFigures(
        useful / wall if wall > 0 else math.nan,
        _pct(ttft, 50),
        _pct(ttft, 99),
        _pct(itl, 50),
        _pct(itl, 99),
        wall,
        float(np.mean(itl)) if itl else math.nan,
    )
    out.ttft_each_s = [r["token_times"][0] - r["arrival"] if r["token_times"] else math.nan for r in requests]
    out.server_each_s = [float(r["server_s"]) for r in requests if "server_s" in r]
    if reference is not None:
        out.compared, out.matched = min(len(requests), len(reference)), 0
        for i, (r, ref) in enumerate(zip(requests, reference)):
            got = list(r["tokens"])[: len(ref)]
            if got == list(ref):
                out.matched += 1
            elif not out.first_mismatch:
                at = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                out.first_mismatch = f"request {i} at token {at}"
    return out


@dataclass(slots=True)
class EngineResult:
    engine: str
    key: str = ""
    """``shard``, ``vllm`` or ``transformers``: what the report and the goals look engines up by."""
    runs: dict[str, RunFigures] = field(default_factory=dict)
    """Per run: the best of its alternated rounds (``plan.merge_rounds``), or the only one."""
    rounds: dict[str, list[RunFigures]] = field(default_factory=dict)
    """Per run: every round's figures, in the order they ran (one entry: the run was not repeated)."""
    peak_rss_bytes: int = 0
    setup_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    skipped: str = ""
    """Why the engine did not run (empty when it did)."""
    anatomy: dict[str, float] = field(default_factory=dict)
    """Mean seconds per decode step by part in the burst run (this shard only)."""
    anatomies: dict[str, dict[str, float]] = field(default_factory=dict)
    """The same for every run, by run name (this shard only)."""


def python_env(threads: int) -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    return env


def this_python() -> str:
    return sys.executable
