"""The end-to-end bench's configuration and per-mode figures: what every mode is given and what it measures."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tgi_paged_backend.planning.workload import TraceRequest

STOCK = "stock-tgi"
CONTIGUOUS = "contiguous"


@dataclass(frozen=True, slots=True, kw_only=True)
class E2EConfig:
    model_dir: Path
    trace: tuple[TraceRequest, ...]
    num_blocks: int | None = 513
    """``TGI_PAGED_NUM_BLOCKS``: physical blocks incl. the scratch block; the KV budget of every mode.
    ``None`` leaves the shard to size its pool from memory (shard modes only)."""
    block_size: int = 1
    """Of every shard mode. 1 (token pages) is stock TGI 3.x's default paging (flashinfer)."""
    overcommits: tuple[float, ...] = (3.0, 4.0, 6.0, 8.0)
    max_input_tokens: int = 128
    max_batch_prefill_tokens: int = 256
    threads: int | None = 1
    """torch threads for every mode (``OMP_NUM_THREADS`` for the shard); ``None``: torch's default.
    One thread by default: on a shared 2-core machine two OpenMP threads stall each other (measured
    10x slower steps under load), and the router replay needs the other core."""
    scrape_interval_s: float = 0.25
    run_contiguous: bool = True
    run_stock: bool = True
    seed: int = 0
    extra_env: tuple[tuple[str, str], ...] = ()
    ready_timeout_s: float = 300.0

    @property
    def max_new_tokens(self) -> int:
        return max(r.max_new_tokens for r in self.trace)

    @property
    def max_total_tokens(self) -> int:
        return self.max_input_tokens + self.max_new_tokens

    @property
    def kv_tokens(self) -> int:
        if self.num_blocks is None:
            raise ValueError("the contiguous baseline needs num_blocks (the shared KV budget)")
        return (self.num_blocks - 1) * self.block_size


@dataclass(slots=True)
class RequestRecord:
    idx: int
    input_length: int
    output_tokens: int
    arrival: float
    """Seconds after the run's start."""
    token_times: list[float] = field(default_factory=list)
    """Seconds after the run's start, one per received token."""


@dataclass(slots=True)
class ModeResult:
    mode: str
    overcommit: float | None
    wall_s: float
    useful_tokens: int
    tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    peak_admitted: int
    """Most requests admitted at once (router entries, or rows of a static batch)."""
    peak_running: int
    """Most requests computing at once (shard gauge; static batch rows)."""
    mean_batch: float
    """Mean requests per forward step."""
    preemptions: dict[str, int]
    recomputed_tokens: int
    computed_tokens: int
    waste_internal: float
    waste_reservation: float
    waste_external: float
    idle_queued: float
    """Free pool share while requests queued in the router but not on the KV budget (behind the prefill
    budget, or arrived since its last admission attempt): compute-bound, not waste."""
    virtual_unbacked: float
    kv_used: float
    setup_s: float
    pool_tokens: int
    """Usable physical KV token slots (the shard's ``tgi_paged_kv_physical_tokens``)."""
    shard_waste: dict[str, float] = field(default_factory=dict)
    """Means of the shard's own ``tgi_paged_kv_waste_ratio{kind}`` gauges while requests were live
    (internal: of used blocks' slots; reservation: of router-reserved slots; external: stranded blocks
    of the pool). Empty for the contiguous baseline."""
    notes: list[str] = field(default_factory=list)
    samples: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @property
    def recompute_tax(self) -> float:
        return self.recomputed_tokens / self.computed_tokens if self.computed_tokens else 0.0

    @property
    def waste_total(self) -> float:
        return self.waste_internal + self.waste_reservation + self.waste_external

    @property
    def label(self) -> str:
        return self.mode if self.overcommit is None or self.mode != "paged" else f"paged oc {self.overcommit:g}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(recompute_tax=self.recompute_tax, waste_total=self.waste_total, label=self.label)
        return out


def cpu_probe_ms(repeats: int = 30) -> float:
    """Milliseconds of a fixed single-thread matmul loop: how fast this machine is right now (noisy
    neighbours show up here; printed per mode so that uneven load between modes is visible)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(384, 384)
        t = time.perf_counter()
        for _ in range(repeats):
            a = torch.tanh(a @ a)
        return 1000 * (time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else math.nan


def client_figures(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """What the clients saw, the same in every mode: wall time to the last token, useful tokens and the
    rates, TTFT and inter-token latency percentiles (keyword arguments of :class:`ModeResult`)."""
    wall = max(t for r in records for t in r.token_times)
    useful = sum(r.output_tokens for r in records)
    ttft = [r.token_times[0] - r.arrival for r in records if r.token_times]
    itl = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:])]
    return {
        "wall_s": wall,
        "useful_tokens": useful,
        "tokens_per_s": useful / wall,
        "requests_per_s": len(records) / wall,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50),
        "itl_p99_s": _pct(itl, 99),
    }
