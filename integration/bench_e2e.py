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
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tgi_paged_backend.bench.allocator_sim import pick_overcommit
from tgi_paged_backend.bench.workload import TraceRequest
from tgi_paged_backend.config import DEFAULT_OVERCOMMIT

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


def _latency_figures(records: Sequence[RequestRecord]) -> dict[str, float]:
    ttft = [r.token_times[0] - r.arrival for r in records if r.token_times]
    itl = [b - a for r in records for a, b in zip(r.token_times, r.token_times[1:])]
    return {
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50),
        "itl_p99_s": _pct(itl, 99),
    }


# --------------------------------------------------------------------------------------- prompts
def build_prompts(tokenizer: Any, trace: Sequence[TraceRequest], seed: int = 0) -> list[str]:
    """One text per request that the tokenizer turns into exactly ``prompt_tokens`` tokens
    (special tokens included, as the router counts ``input_length``).

    Words are whole-word vocabulary entries (a leading-space marker and 3-8 lowercase letters), so
    the concatenation re-tokenizes word by word.
    """
    rng = np.random.default_rng(seed + 17)
    vocab = tokenizer.get_vocab()
    words = sorted(
        {
            tokenizer.convert_tokens_to_string([t]).strip()
            for t in vocab
            if len(t) >= 4
            and (t[0] in "\u0120\u2581")
            and t[1:].isascii()
            and t[1:].isalpha()
            and t[1:].islower()
            and len(t) <= 9
        }
    )
    words = [w for w in words if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1][:4000]
    if len(words) < 50:  # small test tokenizers: any alphabetic piece will do (lengths are then approximate)
        words = sorted(
            {w for w in (tokenizer.convert_tokens_to_string([t]).strip() for t in vocab) if w.isascii() and w.isalpha()}
        ) or ["a"]

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=True))

    prompts = []
    for req in trace:
        chosen = [words[i] for i in rng.integers(0, len(words), req.prompt_tokens)]
        while len(chosen) > 1 and count(" ".join(chosen)) > req.prompt_tokens:
            chosen.pop()
        for _ in range(4 * req.prompt_tokens):  # re-tokenization may merge words: top up
            if count(" ".join(chosen)) >= req.prompt_tokens:
                break
            chosen.append(words[int(rng.integers(0, len(words)))])
        while len(chosen) > 1 and count(" ".join(chosen)) > req.prompt_tokens:
            chosen.pop()
        prompts.append(" ".join(chosen))
    return prompts


# ------------------------------------------------------------------------------------- contiguous
def run_contiguous(cfg: E2EConfig, prompts: Sequence[str], *, log=print) -> ModeResult:
    """HF transformers static padded batches over a max-length cache of the same KV bytes."""
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)
    t_setup = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tok = transformers.AutoTokenizer.from_pretrained(cfg.model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32).eval()
    ids = [tok.encode(p, add_special_tokens=True) for p in prompts]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    cap = cfg.max_new_tokens
    kv_tokens = cfg.kv_tokens
    order = sorted(range(len(cfg.trace)), key=lambda i: cfg.trace[i].arrival)
    records = {i: RequestRecord(i, len(ids[i]), cfg.trace[i].output_tokens, cfg.trace[i].arrival) for i in order}
    # warm up the kernels once (not timed)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[order[0]][:8]]), logits_to_keep=1)
    setup_s = time.perf_counter() - t_setup
    acc = {"t": 0.0, "internal": 0.0, "reservation": 0.0, "external": 0.0, "used": 0.0}
    samples: dict[str, list[float]] = {"t": [], "running": []}
    rows_per_step: list[int] = []
    computed = peak = 0
    load_before, probe = os.getloadavg()[0], cpu_probe_ms()
    t0 = time.perf_counter()
    pos = 0
    with torch.inference_mode():
        while pos < len(order):
            now = time.perf_counter() - t0
            first = cfg.trace[order[pos]].arrival
            if first > now:
                time.sleep(first - now)
                now = first
            batch: list[int] = []
            longest = 0
            while pos < len(order) and cfg.trace[order[pos]].arrival <= now:
                i = order[pos]
                longest_if = max(longest, len(ids[i]))
                if batch and (len(batch) + 1) * (longest_if + cap) > kv_tokens:
                    break
                batch.append(i)
                longest = longest_if
                pos += 1
            rows, P = len(batch), longest
            L = P + cap
            peak = max(peak, rows)
            input_ids = torch.full((rows, P), pad_id, dtype=torch.long)
            mask = torch.zeros((rows, L), dtype=torch.long)
            for r, i in enumerate(batch):
                input_ids[r, P - len(ids[i]) :] = torch.tensor(ids[i])
                mask[r, P - len(ids[i]) :] = 1
            positions = (mask[:, :P].cumsum(-1) - 1).clamp(min=0)
            cache = transformers.StaticCache(config=model.config, max_cache_len=L)
            steps = max(cfg.trace[i].output_tokens for i in batch)
            padding = sum(P - len(ids[i]) for i in batch)
            t_step = time.perf_counter()
            out = model(
                input_ids=input_ids,
                attention_mask=mask[:, :P],
                position_ids=positions,
                past_key_values=cache,
                cache_position=torch.arange(P),
                use_cache=True,
                logits_to_keep=1,
            )
            computed += sum(len(ids[i]) for i in batch)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            last_pos = positions[:, -1:]
            for g in range(1, steps + 1):  # g tokens generated after this step
                if g > 1:
                    mask[:, P + g - 2] = 1
                    last_pos = last_pos + 1
                    out = model(
                        input_ids=nxt,
                        attention_mask=mask[:, : P + g - 1],
                        position_ids=last_pos,
                        past_key_values=cache,
                        cache_position=torch.tensor([P + g - 2]),
                        use_cache=True,
                    )
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                    computed += rows
                t_now = time.perf_counter()
                dt, t_step = t_now - t_step, t_now
                stamp = t_now - t0
                for i in batch:
                    if g <= cfg.trace[i].output_tokens:
                        records[i].token_times.append(stamp)
                rows_per_step.append(rows)
                # KV accounting for this step (slots of the budget).
                written = P + g - 1  # positions per row with K/V (padding included)
                garbage = sum(max(g - cfg.trace[i].output_tokens, 0) for i in batch)
                useful = sum(len(ids[i]) + min(g, cfg.trace[i].output_tokens) - 1 for i in batch)
                waiting = pos < len(order) and cfg.trace[order[pos]].arrival <= stamp
                acc["t"] += dt
                acc["internal"] += dt * (padding + garbage)
                acc["reservation"] += dt * rows * (L - written)
                acc["external"] += dt * ((kv_tokens - rows * L) if waiting else 0)
                acc["used"] += dt * useful
                samples["t"].append(stamp)
                samples["running"].append(rows)
            log(
                f"  contiguous: batch of {rows} (prompt pad {P}, cache {L} tokens/row) ran {steps} steps, "
                f"{time.perf_counter() - t0:.1f} s"
            )
    wall = max(t for r in records.values() for t in r.token_times)
    useful_tokens = sum(r.output_tokens for r in records.values())
    share = {
        k: acc[k] / acc["t"] / kv_tokens if acc["t"] else 0.0 for k in ("internal", "reservation", "external", "used")
    }
    return ModeResult(
        mode=CONTIGUOUS,
        overcommit=None,
        wall_s=wall,
        useful_tokens=useful_tokens,
        tokens_per_s=useful_tokens / wall,
        requests_per_s=len(records) / wall,
        **_latency_figures(list(records.values())),
        peak_admitted=peak,
        peak_running=peak,
        mean_batch=float(np.mean(rows_per_step)),
        preemptions={"recompute": 0, "swap": 0},
        recomputed_tokens=0,
        computed_tokens=computed,
        waste_internal=share["internal"],
        waste_reservation=share["reservation"],
        waste_external=share["external"],
        idle_queued=0.0,
        virtual_unbacked=0.0,
        kv_used=share["used"],
        setup_s=setup_s,
        pool_tokens=kv_tokens,
        notes=[
            f"rows x (longest prompt + {cap}) <= {kv_tokens} KV token slots per batch",
            f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; cpu probe {probe:.0f} ms before, "
            f"{cpu_probe_ms():.0f} ms after",
        ],
        samples=samples,
    )


# ------------------------------------------------------------------------------------------ shard
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int, timeout: float = 2.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` from ``http://127.0.0.1:PORT/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        text = resp.read().decode("utf-8")
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def _get(metrics: dict, name: str, **labels: str) -> float:
    want = tuple(sorted(labels.items()))
    for (n, lab), v in metrics.items():
        if n == name and all(item in lab for item in want):
            return v
    return 0.0


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

    async def sampler() -> None:
        while True:
            try:
                m = await asyncio.to_thread(scrape, port)
            except OSError:
                m = None
            if m is not None:
                samples["t"].append(time.perf_counter() - t0)
                samples["running"].append(_get(m, "tgi_paged_requests", state="running"))
                samples["preempted"].append(_get(m, "tgi_paged_requests", state="preempted"))
                samples["waiting"].append(_get(m, "tgi_paged_requests", state="waiting"))
                stats = router.stats
                samples["queued"].append(float(stats.queue_length))
                samples["queue_blocked_on_kv"].append(float(stats.queue_blocked_on_kv))
                for state in ("used", "free", "retained"):
                    samples[f"{state}_blocks"].append(_get(m, "tgi_paged_kv_blocks", state=state))
                samples["pool_tokens"].append(_get(m, "tgi_paged_kv_physical_tokens"))
                samples["reserved_tokens"].append(_get(m, "tgi_paged_kv_virtual_reserved_tokens"))
                for kind in ("internal", "reservation", "external"):
                    samples[f"{kind}_ratio"].append(_get(m, "tgi_paged_kv_waste_ratio", kind=kind))
            await asyncio.sleep(cfg.scrape_interval_s)

    sampling = asyncio.create_task(sampler())
    try:
        await asyncio.gather(*(one(r) for r in records))
    finally:
        sampling.cancel()
    return records, samples


def run_shard_mode(cfg: E2EConfig, prompts: Sequence[str], overcommit: float, *, mode: str, log=print) -> ModeResult:
    """Spawn the shard with ``overcommit``, replay the trace through the router, scrape its metrics."""
    from integration.launcher_spawn import LaunchedShards, LauncherOptions
    from integration.router_replay import Router

    port = _free_port()
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
    return _shard_result(cfg, mode, overcommit, records, samples, counters, stats, setup_s)


def _params(n: int):
    from integration.router_replay import GenerateParameters

    return GenerateParameters(max_new_tokens=n, ignore_eos_token=True)


def _shard_result(
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
        return _get(after, name, **labels) - _get(before, name, **labels)

    preemptions = {m: int(delta("tgi_paged_preemptions_total", mode=m)) for m in ("recompute", "swap")}
    recomputed = int(delta("tgi_paged_recomputed_tokens_total"))
    computed_counter = int(delta("tgi_paged_computed_tokens_total"))
    batch_sum, batch_count = delta("tgi_paged_batch_size_sum"), delta("tgi_paged_batch_size_count")
    received = sum(len(r.token_times) for r in records)
    # The shard's own counter when it has one; else prompt + generated (+1 for the token a disconnect
    # costs) + recomputed, counted client-side.
    computed = computed_counter or sum(r.input_length for r in records) + received + len(records) + recomputed
    wall = max(t for r in records for t in r.token_times)
    useful = sum(r.output_tokens for r in records)
    # Waste from the gauges, in slots of the physical pool, averaged over samples with live work.
    bs = cfg.block_size
    pool_tokens = int(_get(after, "tgi_paged_kv_physical_tokens"))
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
        wall_s=wall,
        useful_tokens=useful,
        tokens_per_s=useful / wall,
        requests_per_s=len(records) / wall,
        **_latency_figures(records),
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


# ------------------------------------------------------------------------------------------- all
@dataclass(slots=True)
class E2EReport:
    config: dict[str, Any]
    results: list[ModeResult]
    recommended_overcommit: float | None
    recommendation: str
    elapsed_s: float

    def by_label(self) -> dict[str, ModeResult]:
        return {r.label: r for r in self.results}

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "results": [r.to_dict() for r in self.results],
            "recommended_overcommit": self.recommended_overcommit,
            "recommendation": self.recommendation,
            "elapsed_s": self.elapsed_s,
        }


def recommend(
    results: Sequence[ModeResult],
    *,
    max_recompute_tax: float = 0.10,
    tolerance: float = 0.05,
    waste_tolerance: float = 0.01,
) -> tuple[float | None, str]:
    """The smallest measured overcommit within ``tolerance`` of the best paged tokens/s and within
    ``waste_tolerance`` (absolute) of the lowest KV waste, among runs whose recompute tax stays under
    ``max_recompute_tax``; when none is within both, the fastest of those within the waste tolerance
    (waste is steady run to run, wall-clock tokens/s is not). The simulation's ``advise_overcommit``
    applies the same rule with a tighter throughput tolerance."""
    paged = [r for r in results if r.mode == "paged"]
    if not paged:
        return None, "no paged run"
    ok = [r for r in paged if r.recompute_tax <= max_recompute_tax] or paged
    by_overcommit = {r.overcommit or 0.0: r for r in ok}
    chosen = by_overcommit[
        pick_overcommit(
            {k: (r.tokens_per_s, r.waste_total) for k, r in by_overcommit.items()},
            tolerance=tolerance,
            waste_tolerance=waste_tolerance,
        )
    ]
    fallback = chosen.tokens_per_s < (1 - tolerance) * max(r.tokens_per_s for r in ok)
    rule = "no run met both tolerances: the fastest within the waste tolerance; " if fallback else ""
    others = ", ".join(
        f"{r.overcommit:g}: {r.tokens_per_s:.1f} tok/s, waste {100 * r.waste_total:.1f} %, "
        f"tax {100 * r.recompute_tax:.1f} %, {sum(r.preemptions.values())} preemptions"
        for r in sorted(paged, key=lambda r: r.overcommit or 0)
    )
    why = (
        f"{rule}smallest overcommit within {100 * tolerance:.0f} % of the best measured tokens/s and "
        f"{100 * waste_tolerance:.0f} point of the lowest waste, recompute tax <= {100 * max_recompute_tax:.0f} % "
        f"({others})"
    )
    return chosen.overcommit, why


def run_all(cfg: E2EConfig, *, log=print) -> E2EReport:
    """Contiguous, stock-TGI mode and paged at each overcommit, one after the other."""
    import transformers

    t0 = time.perf_counter()
    tok = transformers.AutoTokenizer.from_pretrained(cfg.model_dir)
    prompts = build_prompts(tok, cfg.trace, cfg.seed)
    results: list[ModeResult] = []
    if cfg.run_contiguous:
        log("contiguous (HF static batch) ...")
        results.append(run_contiguous(cfg, prompts, log=log))
    if cfg.run_stock:
        log("stock-TGI mode (overcommit 1) ...")
        results.append(run_shard_mode(cfg, prompts, 1.0, mode=STOCK, log=log))
    for oc in cfg.overcommits:
        log(f"paged (overcommit {oc:g}) ...")
        results.append(run_shard_mode(cfg, prompts, oc, mode="paged", log=log))
    oc, why = recommend(results)
    config = {
        "model_dir": str(cfg.model_dir),
        "requests": len(cfg.trace),
        "num_blocks": cfg.num_blocks,
        "block_size": cfg.block_size,
        "kv_tokens": results[0].pool_tokens if results else 0,
        "max_new_tokens": cfg.max_new_tokens,
        "max_input_tokens": cfg.max_input_tokens,
        "max_total_tokens": cfg.max_total_tokens,
        "max_batch_prefill_tokens": cfg.max_batch_prefill_tokens,
        "threads": cfg.threads,
        "overcommits": list(cfg.overcommits),
        "seed": cfg.seed,
        "prompt_mean": float(np.mean([r.prompt_tokens for r in cfg.trace])),
        "output_mean": float(np.mean([r.output_tokens for r in cfg.trace])),
        "cpu_count": os.cpu_count(),
    }
    return E2EReport(config, results, oc, why, time.perf_counter() - t0)


def format_report(report: E2EReport) -> str:
    from tgi_paged_backend.bench.report import pct, ratio, table

    res = report.results
    base = next((r for r in res if r.mode == CONTIGUOUS), None)
    stock = next((r for r in res if r.mode == STOCK), None)
    headers = ["", *(r.label for r in res)]

    def row(label: str, fn) -> list[str]:
        return [label, *(fn(r) for r in res)]

    rows = [
        row("tokens/s", lambda r: f"{r.tokens_per_s:.1f}"),
        row("  vs contiguous", lambda r: ratio(r.tokens_per_s, base.tokens_per_s) if base else "n/a"),
        row("  vs stock-TGI mode", lambda r: ratio(r.tokens_per_s, stock.tokens_per_s) if stock else "n/a"),
        row("requests/s", lambda r: f"{r.requests_per_s:.3f}"),
        row("wall s", lambda r: f"{r.wall_s:.1f}"),
        row("TTFT p50 / p99 s", lambda r: f"{r.ttft_p50_s:.2f} / {r.ttft_p99_s:.2f}"),
        row("ITL p50 / p99 s", lambda r: f"{r.itl_p50_s:.3f} / {r.itl_p99_s:.3f}"),
        row("peak admitted", lambda r: str(r.peak_admitted)),
        row("  vs stock-TGI mode", lambda r: ratio(r.peak_admitted, stock.peak_admitted) if stock else "n/a"),
        row("peak running / mean batch", lambda r: f"{r.peak_running} / {r.mean_batch:.1f}"),
        row("preemptions recompute/swap", lambda r: f"{r.preemptions['recompute']}/{r.preemptions['swap']}"),
        row("recompute tax", lambda r: pct(r.recompute_tax)),
        row("KV waste (pool share)", lambda r: pct(r.waste_total)),
        row(
            "  internal/reserv./external",
            lambda r: f"{100 * r.waste_internal:.1f}/{100 * r.waste_reservation:.1f}/{100 * r.waste_external:.1f}",
        ),
        row("  idle, queue not KV-bound", lambda r: pct(r.idle_queued)),
        row("  virtual reserved, unbacked", lambda r: pct(r.virtual_unbacked)),
        row("KV holding tokens", lambda r: pct(r.kv_used)),
        row(
            "shard gauges internal/extern.",
            lambda r: (
                f"{100 * r.shard_waste['internal']:.1f}/{100 * r.shard_waste['external']:.1f}"
                if r.shard_waste
                else "n/a"
            ),
        ),
        row("KV pool token slots", lambda r: str(r.pool_tokens)),
    ]
    c = report.config
    head = (
        f"{c['requests']} requests (prompt mean {c['prompt_mean']:.1f}, output mean {c['output_mean']:.1f}, "
        f"max_new_tokens {c['max_new_tokens']}), KV {c['kv_tokens']} token slots "
        f"({c['num_blocks']} blocks x {c['block_size']} incl. scratch) in every mode; {c['cpu_count']} CPUs, "
        f"threads {c['threads'] or 'default'}"
    )
    targets = _targets(report)
    notes = [f"  {r.label}: {'; '.join(r.notes)}" for r in res]
    return "\n".join(
        [
            head,
            "",
            table(headers, rows),
            "",
            "notes:",
            *notes,
            "",
            targets,
            "",
            f"recommended TGI_PAGED_OVERCOMMIT={report.recommended_overcommit}: {report.recommendation}",
            f"(total {report.elapsed_s:.0f} s)",
        ]
    )


def _targets(report: E2EReport) -> str:
    res = report.results
    base = next((r for r in res if r.mode == CONTIGUOUS), None)
    stock = next((r for r in res if r.mode == STOCK), None)
    # The shard's default overcommit when it was measured (the backend "with its defaults"), else the
    # recommended one.
    paged = {r.overcommit: r for r in res if r.mode == "paged"}
    chosen = paged.get(DEFAULT_OVERCOMMIT) or paged.get(report.recommended_overcommit)
    if chosen is None:
        return "targets: no paged run"
    which = "the default" if chosen.overcommit == DEFAULT_OVERCOMMIT else "recommended"
    block_size = report.config.get("block_size", "?")
    lines = [f"targets (paged oc {chosen.overcommit:g}, {which}; block size {block_size} in every shard mode):"]

    def check(name: str, value: float, target: float, fmt: str, higher: bool = True) -> None:
        ok = value >= target if higher else value < target
        lines.append(
            f"  {name:44s} {fmt.format(value):>9s}  target {'>=' if higher else '<'} "
            f"{fmt.format(target):>6s}  {'met' if ok else 'NOT met'}"
        )

    if base:
        check("tokens/s vs contiguous", chosen.tokens_per_s / base.tokens_per_s, 2.0, "{:.2f}x")
    if stock:
        check(
            "admitted concurrency vs stock-TGI mode", chosen.peak_admitted / max(stock.peak_admitted, 1), 3.0, "{:.2f}x"
        )
        check("tokens/s vs stock-TGI mode", chosen.tokens_per_s / stock.tokens_per_s, 1.5, "{:.2f}x")
    check("KV waste (internal + external)", 100 * chosen.waste_total, 2.0, "{:.1f}%", higher=False)
    check("recompute tax", 100 * chosen.recompute_tax, 10.0, "{:.1f}%", higher=False)
    return "\n".join(lines)


def plot_report(report: E2EReport, path: str | Path) -> Path:
    from tgi_paged_backend.bench.report import _pyplot

    plt = _pyplot()
    res = report.results
    labels = [r.label for r in res]
    colors = ["#d62728" if r.mode == CONTIGUOUS else "#ff7f0e" if r.mode == STOCK else "#2ca02c" for r in res]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax = axes[0][0]
    ax.bar(labels, [r.tokens_per_s for r in res], color=colors)
    ax.set_title("useful tokens/s")
    ax = axes[0][1]
    x = np.arange(len(res))
    ax.bar(x - 0.2, [r.ttft_p50_s for r in res], 0.4, label="TTFT p50")
    ax.bar(x + 0.2, [r.ttft_p99_s for r in res], 0.4, label="TTFT p99")
    ax.set_xticks(x, labels)
    ax.set_ylabel("s")
    ax.legend()
    ax.set_title("time to first token")
    ax = axes[1][0]
    for r, color in zip(res, colors):
        ls = "-" if r.mode != "paged" else ["-", "--", ":", "-."][int(r.overcommit or 0) % 4]
        ax.plot(r.samples.get("t", []), r.samples.get("running", []), ls, color=color, label=r.label, lw=1.2)
    ax.set_xlabel("s")
    ax.set_title("requests computing (shard gauge; static batch rows)")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    bottoms = np.zeros(len(res))
    for kind, color in (
        ("kv_used", "#1f77b4"),
        ("waste_internal", "#9467bd"),
        ("waste_reservation", "#8c564b"),
        ("waste_external", "#7f7f7f"),
    ):
        values = np.array([100 * getattr(r, kind) for r in res])
        ax.bar(labels, values, bottom=bottoms, color=color, label=kind.replace("kv_used", "written K/V"))
        bottoms += values
    ax.set_ylabel("% of KV pool (time average)")
    ax.set_title("KV memory")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=4, fontsize=8)
    c = report.config
    fig.suptitle(
        f"end to end on CPU: {c['requests']} requests, KV {c['kv_tokens']} tokens, max_new_tokens {c['max_new_tokens']}"
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(report: E2EReport, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "e2e.json"
    js.write_text(json.dumps(report.to_dict(), indent=2, default=str))
    return js, plot_report(report, out / "e2e.png")
