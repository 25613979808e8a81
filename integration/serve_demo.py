"""The main demo: SmolLM2 behind TGI's HTTP API, with more requests running than physical KV memory holds.

One command (``python examples/serve_smollm2.py``, or ``python -m integration.serve_demo``):

1. ensures SmolLM2-135M-Instruct as a local safetensors directory (progress bar; once);
2. spawns ``text-generation-server serve`` exactly as the TGI launcher does, with a physical KV pool
   (``TGI_PAGED_NUM_BLOCKS``) sized for about ``--fit`` requests while ``--requests`` run, and
   ``PREFIX_CACHING=0``;
3. connects the v3 router replay (``max_batch_prefill_tokens`` 1024) and serves TGI's HTTP API on
   127.0.0.1 (a free port);
4. sends the chat requests concurrently with ``huggingface_hub.InferenceClient(base_url).chat_completion``
   (every second one streaming), greedy, and prints the answers;
5. prints a KV memory report: physical blocks (peak), waste split, admitted concurrency vs what stock
   TGI's worst-case reservation admits on the same physical pool, preemptions by mode, recompute tax;
   for a model with KV layer groups (Gemma 2/3, gpt-oss, Cohere 2 with ``--model-dir``), one line per
   group at the pool's peak (:func:`group_lines`).

The shard-side numbers come from :func:`fetch_shard_memory_report`, which reads, in order of
preference: the shard's Prometheus endpoint (``TGI_PAGED_METRICS_PORT``, polled during the run), a
one-line JSON memory summary in the shard's log (``{"event": "kv_memory", ...}``, see
:data:`LOG_SUMMARY_FIELDS`), then the lines the shard already logs (Warmup sizing, preemption
summaries). Whatever none of them provides is reported as missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from integration.net import free_port
from integration.prometheus_text import Samples, scrape
from integration.tier_report import tier_lines
from tgi_paged_backend.config import DEFAULT_OVERCOMMIT

PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for writing clean Python code.",
    "Explain in two sentences what a KV cache is in a transformer.",
    "Write a haiku about autumn leaves.",
    "What is 17 times 23? Show your work briefly.",
    "Name three planets of the solar system and one fact about each.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Suggest a name for a friendly robot and explain why.",
)
LOG_SUMMARY_FIELDS = {
    "event": '"kv_memory" (marks the line)',
    "block_size": "tokens per block",
    "blocks_total": "usable physical blocks (scratch block excluded)",
    "blocks_used_peak": "most physical blocks in use at once since start",
    "waste_slots": '{"internal", "reservation", "external"}: slots, summed over steps (or ratios, any)',
    "preemptions": '{"recompute": n, "swap": n} since start',
    "tokens_computed": "positions computed since start, recomputed ones included",
    "tokens_recomputed": "positions computed again after recompute-mode preemption",
    "running_peak": "most requests computing in one step",
}
"""The JSON the shard may log (one line per N steps, latest wins) for this report; keys optional."""

_WARMUP = re.compile(r"warmup: (\d+) physical blocks x (\d+) tokens = (\d+) tokens; advertising (\d+)")
_PRESSURE = re.compile(r"since start \(([^)]*)\)")
_LORA = re.compile(r"warmup: weights ([\d.]+) MiB, of which LoRA adapters ([\d.]+) MiB \((\d+) adapters\)")


@dataclass(frozen=True, slots=True)
class GroupBlocks:
    """One KV layer group in one scrape of ``tgi_paged_kv_group_blocks{group,window,state}``."""

    group: int
    window: int | None
    """The group's sliding window in tokens, ``None`` for full attention."""
    held: int
    """Blocks the group's page maps of live requests hold (``state="held"``)."""
    reclaimed: int
    """Blocks the group gave back behind its window for live requests (``state="reclaimed"``)."""
    internal_waste: float | None = None
    """Unfilled slots of the blocks it holds over their slots (``tgi_paged_kv_group_waste_ratio``)."""


def group_blocks(values: Samples) -> list[GroupBlocks]:
    """The per-group gauges of one scrape, by group (empty for a model of one group: none exported)."""
    found: dict[int, dict[str, Any]] = {}
    for (name, labels), value in values.items():
        label = dict(labels)
        if name == "tgi_paged_kv_group_waste_ratio" and "group" in label:
            found.setdefault(int(label["group"]), {"window": label.get("window", "full")})["waste"] = value
        if name != "tgi_paged_kv_group_blocks":
            continue
        if "group" not in label or label.get("state") not in ("held", "reclaimed"):
            continue
        entry = found.setdefault(int(label["group"]), {"window": label.get("window", "full")})
        entry[label["state"]] = int(value)
    return [
        GroupBlocks(
            group,
            None if entry["window"] == "full" else int(entry["window"]),
            entry.get("held", 0),
            entry.get("reclaimed", 0),
            entry.get("waste"),
        )
        for group, entry in sorted(found.items())
    ]


class ShardMetricsPoller:
    """Scrapes ``http://127.0.0.1:{port}/metrics`` every ``interval_s`` in a thread; keeps peaks and means.

    With KV layer groups, :attr:`peak_groups` is the per-group scrape at the pool's peak (most blocks in
    use), and :attr:`peak_groups_running` the requests running then."""

    def __init__(self, port: int, interval_s: float = 0.2) -> None:
        self.port = port
        self.interval_s = interval_s
        self.samples = 0
        self.peak_used = 0.0
        self.peak_running = 0.0
        self.waste_sums: dict[str, float] = {}
        self.waste_samples = 0
        self.last: Samples = {}
        self.peak_groups: list[GroupBlocks] = []
        self.peak_groups_running = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-metrics", daemon=True)

    def start(self) -> ShardMetricsPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.scrape()  # final counters

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.scrape()

    def scrape(self) -> None:
        try:
            values = scrape(self.port, timeout=2)
        except (OSError, ValueError):  # no answer yet, or a text cut short: the next scrape counts
            return
        self.observe(values)

    def observe(self, values: Samples) -> None:
        """Take one scrape (:func:`integration.prometheus_text.scrape`) into the peaks and means."""
        self.samples += 1
        self.last = values
        used = values.get(("tgi_paged_kv_blocks", (("state", "used"),)), 0.0)
        running = values.get(("tgi_paged_requests", (("state", "running"),)), 0.0)
        groups = group_blocks(values)
        if groups and (used > self.peak_used or not self.peak_groups):
            self.peak_groups, self.peak_groups_running = groups, int(running)
        self.peak_used = max(self.peak_used, used)
        self.peak_running = max(self.peak_running, running)
        if used > 0:
            self.waste_samples += 1
            for kind in ("internal", "reservation", "external"):
                value = values.get(("tgi_paged_kv_waste_ratio", (("kind", kind),)), 0.0)
                self.waste_sums[kind] = self.waste_sums.get(kind, 0.0) + value


@dataclass
class MemoryReport:
    block_size: int | None = None
    blocks_total: int | None = None
    physical_tokens: int | None = None
    advertised_tokens: int | None = None
    blocks_used_peak: int | None = None
    waste: dict[str, float] | None = None
    waste_unit: str = "mean ratio"
    preemptions: dict[str, int] | None = None
    tokens_recomputed: int | None = None
    tokens_computed: int | None = None
    running_peak: int | None = None
    lora: tuple[float, float, int] | None = None
    """``LORA_ADAPTERS``: (weights MiB, of which adapters MiB, adapters), from the Warmup log line."""
    groups: list[GroupBlocks] = field(default_factory=list)
    """KV layer groups at the pool's peak, from ``/metrics`` (empty for a model of one group)."""
    groups_running: int | None = None
    """Requests running at that scrape."""
    tiers: list[str] = field(default_factory=list)
    """The KV tiers' report lines (host RAM, disk), from the last scrape (empty when no tier is on)."""
    sources: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def fetch_shard_memory_report(log_texts: list[str], poller: ShardMetricsPoller | None = None) -> MemoryReport:
    """The shard's KV numbers from ``/metrics`` (preferred), its JSON summary line, or its plain log lines."""
    r = MemoryReport()
    for text in log_texts:
        if match := _WARMUP.search(text):
            blocks, r.block_size, r.physical_tokens, r.advertised_tokens = map(int, match.groups())
            r.blocks_total = blocks - 1
            r.sources.append("warmup log line")
        if match := _LORA.search(text):
            r.lora = (float(match.group(1)), float(match.group(2)), int(match.group(3)))
        if match := _PRESSURE.search(text):
            r.preemptions = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(1))}
    if r.preemptions is not None:
        r.sources.append("preemption log summary")
    summary = _last_summary(log_texts)
    if summary:
        r.sources.append("kv_memory log line")
        r.block_size = summary.get("block_size", r.block_size)
        r.blocks_total = summary.get("blocks_total", r.blocks_total)
        r.blocks_used_peak = summary.get("blocks_used_peak")
        r.waste = summary.get("waste_slots")
        r.waste_unit = "slots" if r.waste and max(r.waste.values(), default=0) > 1 else "mean ratio"
        r.preemptions = summary.get("preemptions", r.preemptions)
        r.tokens_computed = summary.get("tokens_computed")
        r.tokens_recomputed = summary.get("tokens_recomputed")
        r.running_peak = summary.get("running_peak")
    if poller is not None and poller.samples:
        r.sources.append("shard /metrics")
        last = poller.last
        physical = last.get(("tgi_paged_kv_physical_tokens", ()))
        if physical is not None:
            r.physical_tokens = int(physical)
        r.blocks_used_peak = int(poller.peak_used)
        r.running_peak = int(poller.peak_running) or r.running_peak
        if poller.peak_groups:
            r.groups, r.groups_running = list(poller.peak_groups), poller.peak_groups_running
        if poller.waste_samples:
            r.waste = {k: v / poller.waste_samples for k, v in poller.waste_sums.items()}
            r.waste_unit = "mean ratio"
        modes = {
            labels[0][1]: int(v)
            for (name, labels), v in last.items()
            if name == "tgi_paged_preemptions_total" and labels
        }
        if modes:
            r.preemptions = modes
        r.tiers = tier_lines(last)
        recomputed = last.get(("tgi_paged_recomputed_tokens_total", ()))
        if recomputed is not None:
            r.tokens_recomputed = int(recomputed)
    for name in ("blocks_used_peak", "waste", "preemptions", "tokens_recomputed"):
        if getattr(r, name) is None:
            r.missing.append(name)
    return r


def _last_summary(log_texts: list[str]) -> dict[str, Any] | None:
    for text in reversed(log_texts):
        start = text.find("{")
        if start < 0 or '"kv_memory"' not in text:
            continue
        try:
            data = json.loads(text[start:])
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("event") == "kv_memory":
            return data
    return None


def plan_num_blocks(prompt_lengths: list[int], max_new_tokens: int, fit: int, block_size: int = 16) -> int:
    """Physical blocks (scratch block included) for about ``fit`` requests of mean worst-case size."""
    mean = sum(prompt_lengths) / len(prompt_lengths)
    return -(-int(fit * (mean + max_new_tokens)) // block_size) + 1


WASTE_MEANING = {
    "internal": (
        "of the used blocks' slots",
        "physical: the unwritten tail of each request's last block (under one block per request)",
    ),
    "reservation": (
        "of the router's reserved slots",
        "NOT physical here: the router's worst-case booking, backed by blocks only as tokens are written",
    ),
    "external": ("of the pool", "physical: free blocks too few for the pending all-or-nothing allocation"),
}
"""Per waste kind (``tgi_paged_kv_waste_ratio{kind}``): what its ratio is of, and what it costs."""


def waste_lines(report: MemoryReport, *, stock_requests: int | None, per_request: int) -> list[str]:
    """The waste figures, one line each with what it costs in physical memory, and what stock TGI holds."""
    if not report.waste:
        return ["waste (internal / reservation / external): n/a"]
    mean = report.waste_unit == "mean ratio"
    lines = [f"waste ({'mean over the run' if mean else 'slots, summed over steps'}):"]
    for kind, value in report.waste.items():
        of, cost = WASTE_MEANING.get(kind, ("", ""))
        figure = f"{value:6.1%} {of}" if mean else f"{value:g} slots"
        lines.append(f"  {kind:<11} {figure}: {cost}" if cost else f"  {kind:<11} {figure}")
    if "reservation" in report.waste:
        lines.append(
            f"  (stock TGI allocates the whole booking: {per_request} token slots per request from the start"
            + (f", {stock_requests} such requests on this pool)" if stock_requests is not None else ")")
        )
    return lines


def group_lines(report: MemoryReport, *, per_request: int) -> list[str]:
    """One line per KV layer group at the pool's peak (none for a model of one group): its window, the
    blocks it held, those it had given back behind its window, and what one page map for all layers (every
    group keeping every position) would have held for the same positions; then the totals, with what
    stock TGI (the whole booking of each running request, in every group) would have held.

    Block counts are of the grouped pool's blocks (a block holds one group's layers), so the groups add up."""
    if len(report.groups) <= 1:
        return []
    held = sum(g.held for g in report.groups)
    running = "" if report.groups_running is None else f", {report.groups_running} requests running"
    lines = [f"KV layer groups: {len(report.groups)}, blocks at the pool's peak{running}:"]
    for g in report.groups:
        kind = "full" if g.window is None else f"window {g.window}"
        back = f"{g.reclaimed} given back behind the window" if g.window is not None else "keeps every position"
        waste = "" if g.internal_waste is None else f" (internal waste {g.internal_waste:.1%})"
        lines.append(
            f"  group {g.group} ({kind}): {g.held} blocks held{waste}, {back}; "
            f"one page map for all layers: {g.held + g.reclaimed}"
        )
    reclaimed = sum(g.reclaimed for g in report.groups)
    single = held + reclaimed
    total = (
        f"  all groups: {held} held, {reclaimed} given back; one page map for all layers would hold {single} "
        f"for the same positions"
    )
    if single:
        total += f" ({reclaimed / single:.1%} saved)"
    lines.append(total)
    if report.block_size and report.groups_running is not None:
        stock = report.groups_running * -(-per_request // report.block_size) * len(report.groups)
        lines.append(
            f"  (stock TGI holds each running request's whole booking for all layers: {report.groups_running} x "
            f"{-(-per_request // report.block_size)} blocks x {len(report.groups)} groups = {stock} such blocks)"
        )
    return lines


def format_report(
    report: MemoryReport,
    *,
    requests: int,
    admitted_peak: int,
    prompt_lengths: list[int],
    max_new_tokens: int,
    generated_tokens: int,
    elapsed_s: float,
) -> str:
    def show(value: Any) -> str:
        return "n/a" if value is None else str(value)

    mean_prompt = round(sum(prompt_lengths) / len(prompt_lengths))
    per_request = mean_prompt + max_new_tokens
    stock = report.physical_tokens // per_request if report.physical_tokens else None
    over_groups = f" over {len(report.groups)} KV layer groups" if len(report.groups) > 1 else ""
    lines = [
        "",
        "=" * 72,
        "KV memory report",
        "=" * 72,
        f"requests: {requests} concurrent, mean prompt {mean_prompt} tokens, max_new_tokens {max_new_tokens}, "
        f"{generated_tokens} tokens generated in {elapsed_s:.1f}s",
        f"physical pool: {show(report.blocks_total)} blocks x {show(report.block_size)} tokens{over_groups} = "
        f"{show(report.physical_tokens)} tokens (router's virtual budget: {show(report.advertised_tokens)})",
        f"physical blocks used (peak): {show(report.blocks_used_peak)} / {show(report.blocks_total)}",
    ]
    lines += group_lines(report, per_request=per_request)
    lines += report.tiers
    lines += waste_lines(report, stock_requests=stock, per_request=per_request)
    lines.append(
        f"admitted concurrency: {admitted_peak} (router replay peak; shard peak running: {show(report.running_peak)})"
    )
    lines.append(
        f"stock TGI worst-case reservation on the same pool: {show(stock)} "
        f"(= {show(report.physical_tokens)} // ({mean_prompt} + {max_new_tokens}))"
    )
    if report.lora is not None:
        weights, adapters, count = report.lora
        lines.append(
            f"LoRA adapters: {count}, {adapters:.1f} MiB of the {weights:.1f} MiB of weights (out of the KV budget)"
        )
    modes = ", ".join(f"{k}={v}" for k, v in sorted(report.preemptions.items())) if report.preemptions else "n/a"
    lines.append(f"preemptions by mode: {modes}")
    useful = sum(prompt_lengths) + generated_tokens
    if report.tokens_recomputed is not None:
        lines.append(
            f"recompute tax: {report.tokens_recomputed} tokens recomputed = "
            f"{report.tokens_recomputed / max(useful, 1):.1%} of the {useful} useful tokens"
        )
    else:
        lines.append("recompute tax: n/a")
    lines.append(f"sources: {', '.join(dict.fromkeys(report.sources)) or 'none'}")
    if report.missing:
        lines.append(
            f"not exposed by the shard yet: {', '.join(report.missing)} (expected from /metrics on "
            "TGI_PAGED_METRICS_PORT, or a kv_memory JSON log line)"
        )
    return "\n".join(lines)


def _ask(base_url: str, question: str, max_new_tokens: int, stream: bool) -> tuple[str, int, int, str]:
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=base_url, timeout=900)
    messages = [{"role": "user", "content": question}]
    # model="tgi": the stock router forwards any other model name to the shard as a LoRA adapter id.
    if not stream:
        out = client.chat_completion(messages, model="tgi", max_tokens=max_new_tokens, temperature=0)
        return (
            out.choices[0].message.content,
            out.usage.prompt_tokens,
            out.usage.completion_tokens,
            out.choices[0].finish_reason,
        )
    text, usage, finish = [], None, ""
    for chunk in client.chat_completion(
        messages,
        model="tgi",
        max_tokens=max_new_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    return "".join(text), usage.prompt_tokens, usage.completion_tokens, finish


def run_demo(
    requests: int = 8,
    max_new_tokens: int = 48,
    fit: int = 4,
    overcommit: float = DEFAULT_OVERCOMMIT,
    model_dir: str | None = None,
    quiet_progress: bool = False,
) -> str:
    """Run everything; returns the printed report."""
    from transformers import AutoTokenizer

    from integration.http_api import ApiConfig, HttpStack, tokenizer_chat_template
    from integration.launcher_spawn import LaunchedShards, LauncherOptions
    from integration.smollm2 import ensure_smollm2

    model = str(model_dir or ensure_smollm2(progress=not quiet_progress))
    questions = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    tokenizer = AutoTokenizer.from_pretrained(model)
    render = tokenizer_chat_template(tokenizer)
    lengths = [
        len(tokenizer(render([{"role": "user", "content": q}]), add_special_tokens=False).input_ids) for q in questions
    ]
    num_blocks = plan_num_blocks(lengths, max_new_tokens, fit)
    metrics_port = free_port()
    uds = tempfile.mkdtemp(prefix="tgs", dir="/tmp") + "/tgs"
    env = {
        "TGI_PAGED_NUM_BLOCKS": str(num_blocks),
        "PREFIX_CACHING": "0",
        "TGI_PAGED_OVERCOMMIT": str(overcommit),
        "TGI_PAGED_METRICS_PORT": str(metrics_port),
        # The launcher finds `text-generation-server` on PATH: this interpreter's venv first.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    print(
        f"spawning text-generation-server serve {model} (TGI_PAGED_NUM_BLOCKS={num_blocks}: room for ~{fit} "
        f"of {requests} requests) ...",
        flush=True,
    )
    spawned = time.monotonic()
    with LaunchedShards(model, LauncherOptions(uds_path=uds, env=env), ready_timeout=900) as shards:
        print(f"shard ready in {time.monotonic() - spawned:.1f}s; starting router replay + HTTP API", flush=True)
        with HttpStack(
            uds, model, config=ApiConfig(model_id=Path(model).name), router_kwargs={"max_batch_prefill_tokens": 1024}
        ) as stack:
            print(
                f"TGI HTTP API on {stack.base_url}; sending {requests} concurrent chat requests "
                f"(every second one streaming)",
                flush=True,
            )
            poller = ShardMetricsPoller(metrics_port).start()
            started = time.monotonic()
            with ThreadPoolExecutor(requests) as pool:
                futures = [
                    pool.submit(_ask, stack.base_url, q, max_new_tokens, i % 2 == 1) for i, q in enumerate(questions)
                ]
                answers = [f.result() for f in futures]
            elapsed = time.monotonic() - started
            poller.stop()
            admitted = stack.router.stats.concurrency_peak
        for i, (question, (answer, _, tokens, finish)) in enumerate(zip(questions, answers)):
            kind = "stream" if i % 2 else "json"
            print(f"\n[{i}] ({kind}, {tokens} tokens, {finish}) Q: {question}\n    A: {answer.strip()}")
        report = fetch_shard_memory_report([rec.text for rec in shards.logs], poller)
    text = format_report(
        report,
        requests=requests,
        admitted_peak=admitted,
        prompt_lengths=[a[1] for a in answers],
        max_new_tokens=max_new_tokens,
        generated_tokens=sum(a[2] for a in answers),
        elapsed_s=elapsed,
    )
    print(text, flush=True)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8, help="concurrent chat requests (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="max_tokens per request (default 48)")
    parser.add_argument("--fit", type=int, default=4, help="requests the physical pool holds (default 4)")
    parser.add_argument(
        "--overcommit",
        type=float,
        default=DEFAULT_OVERCOMMIT,
        help=f"TGI_PAGED_OVERCOMMIT (default {DEFAULT_OVERCOMMIT:g}, the shard's)",
    )
    parser.add_argument("--model-dir", default=None, help="a local model dir instead of SmolLM2")
    args = parser.parse_args(argv)
    run_demo(args.requests, args.max_new_tokens, args.fit, args.overcommit, args.model_dir)


if __name__ == "__main__":
    main()
