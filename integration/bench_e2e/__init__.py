"""End-to-end benchmark on CPU: the same trace and the same physical KV bytes, served three ways.

- **contiguous**: HF transformers, static padded batches over a max-length ``StaticCache``. A batch
  takes requests FIFO while ``rows x (longest prompt + max_new_tokens)`` fits the KV budget, left-pads
  them, and decodes until its longest answer is done (finished rows keep computing, and nobody joins
  until the whole batch ends). Greedy, EOS ignored: the trace says when each answer ends.
- **stock TGI mode**: the real shard (spawned as the launcher does) with ``TGI_PAGED_OVERCOMMIT=1``,
  driven by the v3 router replay. The router's virtual pool then equals the physical pool and it
  reserves ``prompt + max_new_tokens - 1`` per request, so admission is stock TGI's and nothing is
  ever preempted.
- **paged**: the same shard with its defaults except the overcommit (once per value) and the block
  size (``block_size``, the same for every shard mode; the bench's default is 1, stock TGI's own paging).

Every mode gets ``(num_blocks - 1) x block_size`` token slots of KV (``TGI_PAGED_NUM_BLOCKS``, the
scratch block excluded). Clients send ``max_new_tokens`` = the trace's cap with ``ignore_eos_token``,
and disconnect after ``output_tokens`` tokens (the router drops the request at its next generation,
so the shard computes one token more, as a real EOS would not; counted in ``computed``).

Shard-side figures come from its Prometheus endpoint (``TGI_PAGED_METRICS_PORT``), scraped every
``scrape_interval_s``: preemptions, recomputed tokens, running/preempted requests, pool blocks and
the waste gauges. Waste is reported as a share of the physical pool, time-averaged while requests are
live, in the allocator simulation's terms: internal (unfilled last-block slots), reservation (slots
reserved but unwritten -- physical only under stock allocation, so for the stock-TGI mode this is
what stock TGI would hold; for paged modes it is virtual and reported apart), external (free memory
while a request waits *for memory*: preempted, blocked on KV blocks in the shard, or held in the
router's queue by the KV budget -- its token budget spent or no blocks for the head). Free memory
while requests queue only behind the router's prefill token budget (a compute limit: the pool fills
as fast as prefill steps run) is reported apart as ``idle_queued``, not as waste. For the contiguous
baseline every wait is a wait for memory (a static batch takes as many rows as fit and none can join
it), so all its idle memory while requests wait is external.

It lives in ``integration/`` beside the harness it drives (launcher spawn, router replay), which the
wheel does not ship: run it from a checkout (``examples/bench_e2e.py``; pytest puts the repository
root on ``sys.path`` through ``pythonpath``).

The modules, by concern: :mod:`.results` (the configuration and per-mode figures), :mod:`.prompts`,
:mod:`.contiguous` (the HF baseline), :mod:`.shard` (the spawn and the replay), :mod:`.shard_figures`
(a shard mode's figures from its scrapes), :mod:`.report` (the recommendation, table and
targets), :mod:`.run` (every mode in turn) and :mod:`.plots` (the figure and the JSON).
"""

from __future__ import annotations

from integration.bench_e2e.contiguous import run_contiguous
from integration.bench_e2e.plots import plot_report, write_outputs
from integration.bench_e2e.prompts import build_prompts
from integration.bench_e2e.report import E2EReport, format_report, recommend
from integration.bench_e2e.results import (
    CONTIGUOUS,
    STOCK,
    E2EConfig,
    ModeResult,
    RequestRecord,
    cpu_probe_ms,
)
from integration.bench_e2e.run import run_all
from integration.bench_e2e.shard import run_shard_mode, shard_env

__all__ = [
    "CONTIGUOUS",
    "STOCK",
    "E2EConfig",
    "E2EReport",
    "ModeResult",
    "RequestRecord",
    "build_prompts",
    "cpu_probe_ms",
    "format_report",
    "plot_report",
    "recommend",
    "run_all",
    "run_contiguous",
    "run_shard_mode",
    "shard_env",
    "write_outputs",
]
