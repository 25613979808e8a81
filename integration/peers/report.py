"""The report: the host, then per section (SmolLM2, the host-bound model) the engines side by side with their
ratio to vLLM, the step anatomy beside the bare forward and the time it took; the issue-21 goals at the end."""

from __future__ import annotations

import math
from typing import Any

from integration.peers.goals import engines_by_key, goals_table, issue21_goals, overhead
from integration.peers.host import describe
from integration.peers.jobs import EngineResult, RunFigures
from tgi_paged_backend.planning.report import table
from tgi_paged_backend.telemetry.step_record import STEP_PARTS


def _f(value: float, fmt: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _match(run: RunFigures | None) -> str:
    if run is None or run.matched is None:
        return "n/a"
    text = f"{run.matched}/{run.compared}"
    return text + (" identical" if run.matched == run.compared else f" (first: {run.first_mismatch})")


def _itl(run: RunFigures | None) -> str:
    if run is None:
        return "n/a"
    return " / ".join(_f(1000 * v, "{:.1f}") for v in (run.itl_mean_s, run.itl_p50_s, run.itl_p99_s))


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or not base or math.isnan(value) or math.isnan(base):
        return "n/a"
    return f"{value / base:.2f}x"


def engines_table(results: list[EngineResult], rate: float, config: dict[str, Any] | None = None) -> str:
    """One column per engine that ran; per run its headline, the ratio to vLLM, every round, then the details.

    Headline: tokens/s (useful tokens over first arrival -> last token) for the burst and Poisson runs; for the
    single request the mean ITL in ms, i.e. decode time per token (``vs vLLM`` < 1.0x is faster there).
    """
    config = config or {}
    ran = [r for r in results if not r.skipped]
    vllm = engines_by_key({"results": ran}).get("vllm")
    headers = ["", *(r.engine for r in ran)]
    multi = any(len(v) > 1 for r in ran for v in r.rounds.values())

    def row(label: str, fn) -> list[str]:
        return [label, *(fn(r) for r in ran)]

    rows = []
    runs = [n for n in ("burst", "poisson", "single") if any(n in r.runs for r in ran)]
    for name in runs:
        single = name == "single"
        attr, fmt, scale = ("itl_mean_s", "{:.1f}", 1000.0) if single else ("tokens_per_s", "{:.1f}", 1.0)

        def run(r: EngineResult, name=name) -> RunFigures | None:
            return r.runs.get(name)

        def head(r: EngineResult, run=run, attr=attr, fmt=fmt, scale=scale) -> str:
            return _f(scale * getattr(run(r), attr), fmt) if run(r) else "n/a"

        def versus(r: EngineResult, run=run, attr=attr) -> str:
            base = run(vllm) if vllm else None
            return _ratio(getattr(run(r), attr), getattr(base, attr)) if run(r) and base else "n/a"

        def every(r: EngineResult, name=name, attr=attr, fmt=fmt, scale=scale) -> str:
            return ", ".join(_f(scale * getattr(f, attr), fmt) for f in r.rounds.get(name, [])) or "n/a"

        best = " (best round)" if multi else ""
        if single:
            prompt, new = config.get("single_prompt", "?"), config.get("single_new", 128)
            title = f"single (1 request, {prompt}-token prompt, {new} new)"
            rows.append(row(f"{title}: ms/token (mean ITL){best}", head))
        else:
            title = "burst" if name == "burst" else f"poisson {rate:g}/s"
            rows.append(row(f"{title}: tokens/s{best}", head))
        if vllm:
            rows.append(row("  vs vLLM", versus))
        if multi:
            rows.append(row("  every round, in order", every))
        rows += [
            row(
                "  TTFT p50 / p99 s",
                lambda r, run=run: f"{run(r).ttft_p50_s:.2f} / {run(r).ttft_p99_s:.2f}" if run(r) else "n/a",
            ),
            row("  ITL mean / p50 / p99 ms", lambda r, run=run: _itl(run(r))),
        ]
        if single:
            rows.append(row("  tokens/s", lambda r, run=run: _f(run(r).tokens_per_s, "{:.1f}") if run(r) else "n/a"))
        else:
            rows.append(row("  wall s", lambda r, run=run: _f(run(r).wall_s, "{:.1f}") if run(r) else "n/a"))
        rows.append(row("  greedy tokens vs HF", lambda r, run=run: _match(run(r))))
    rows += [
        row("peak memory (RSS) GiB", lambda r: f"{r.peak_rss_bytes / 2**30:.2f}" if r.peak_rss_bytes else "n/a"),
        row("setup s (load + warm-up)", lambda r: f"{r.setup_s:.0f}"),
    ]
    return table(headers, rows)


def wall_split(wall_s: float, a: dict[str, float], decode_steps: Any) -> str:
    """Where the burst's wall time (the client's first arrival -> last token) goes: the shard's decode and prefill
    steps (its step histogram), and the rest: outside the shard's steps (its servicer and gRPC, the router replay
    and the client on the same cores, and any wait for work)."""
    steps_s = a["decode_total"] + a["prefill_total"]
    rest = wall_s - steps_s
    per_step = (
        f" = {1000 * rest / decode_steps:.2f} ms per decode step"
        if isinstance(decode_steps, int) and decode_steps
        else ""
    )
    return (
        f"burst wall {wall_s:.2f} s: decode steps {a['decode_total']:.2f} s, prefill steps {a['prefill_total']:.2f} s "
        f"({a['prefill_steps']:.0f} steps), outside the shard's steps {rest:.2f} s{per_step} (servicer, gRPC, router "
        "replay, client)"
    )


def anatomy_table(shard: EngineResult | None, bare: dict[str, Any] | None, shape: dict[str, Any]) -> str:
    if shard is None or not shard.anatomy or not shard.anatomy.get("step"):
        return "step anatomy: no decode step measured (shard not run, or it exports no tgi_paged_step_part_seconds)"
    a = shard.anatomy
    total = sum(a[p] for p in STEP_PARTS)
    steps = (shard.anatomies.get("burst") or {}).get("decode_steps") or shape.get("decode_steps", "?")
    best = " (best round)" if len(shard.rounds.get("burst", [])) > 1 else ""
    lines = [
        f"step anatomy (this shard, burst run{best}; mean per decode step over {steps} steps; "
        f"mean running batch {shape.get('batch')}, context {shape.get('context')} tokens):"
    ]
    rows = [[p, f"{1000 * a[p]:.2f}", f"{100 * a[p] / total:.1f} %" if total else "n/a"] for p in STEP_PARTS]
    rows.append(["sum of parts", f"{1000 * total:.2f}", "100.0 %"])
    rows.append(["step (tgi_paged_step_seconds)", f"{1000 * a['step']:.2f}", ""])
    lines.append(table(["part", "ms", "share"], rows))
    measured = overhead(a, bare)
    if bare and measured:
        share, fwd = measured
        lines.append(
            f"bare forward (the HF model alone: {bare['batch']} rows x {bare['context']} cached tokens, one "
            f"decode step, DynamicCache, same threads, same run): {1000 * bare['forward_s']:.2f} ms "
            f"(min {1000 * bare['min_s']:.2f})"
        )
        lines.append(
            f"  engine forward / bare forward: {fwd:.2f}x; engine overhead (everything but the forward): "
            f"{1000 * (total - a['forward']):.2f} ms = {100 * share:.1f} % of the step"
        )
    else:
        lines.append("bare forward: not measured")
    burst = shard.runs.get("burst")
    if burst is not None and "decode_total" in a:
        lines.append(wall_split(burst.wall_s, a, steps))
    single = shard.anatomies.get("single")
    if single and single.get("step"):
        rest = single["step"] - single["forward"]
        lines.append(
            f"single request (batch 1): step {1000 * single['step']:.2f} ms = forward {1000 * single['forward']:.2f} "
            f"ms + everything else {1000 * rest:.2f} ms ({100 * rest / single['step']:.1f} %) per decode step"
        )
    return "\n".join(lines)


def prefill_table(results: list[EngineResult], config: dict[str, Any]) -> str:
    """The ``prefill`` run: per prompt length, each engine's time to first token (best round), this shard's ratio to
    vLLM, and where this shard's time went: its prefill steps, and the rest (router replay, gRPC, the client)."""
    by = engines_by_key({"results": results})
    shard, vllm = (by.get(k).runs.get("prefill") if by.get(k) else None for k in ("shard", "vllm"))
    lengths = config.get("prefill_prompts", [])
    rows = []
    for k, n in enumerate(lengths):

        def at(run: RunFigures | None, attr: str = "ttft_each_s", k=k) -> float | None:
            values = getattr(run, attr) if run else []
            return values[k] if k < len(values) else None

        ours, theirs, server = at(shard), at(vllm), at(shard, "server_each_s")
        rest = None if ours is None or server is None else ours - server
        rows.append(
            [
                str(n),
                *(_f(None if v is None else 1000 * v, "{:.0f}") for v in (ours, theirs)),
                _ratio(ours, theirs),
                *(_f(None if v is None else 1000 * v, "{:.0f}") for v in (server, rest)),
            ]
        )
    head = ["prompt tokens", "shard TTFT ms", "vLLM TTFT ms", "shard / vLLM", "shard prefill steps ms", "rest ms"]
    note = (
        "one request at a time, one new token; best round each; 'rest' = this shard's TTFT minus its prefill steps: "
        "the router replay (tokenizing, validating), gRPC and the client"
    )
    return "\n".join([table(head, rows), note])


def _head(c: dict[str, Any]) -> str:
    model = c.get("model", "?")
    if str(c.get("section", "")).startswith("hostbound"):
        h = c.get("hostbound", {})
        model += (
            f" (host-bound {h.get('form', 'llama')} form: {h.get('num_hidden_layers')} layers, hidden "
            f"{h.get('hidden_size')}, head_dim {h.get('head_dim')}, {h.get('num_attention_heads')} heads / "
            f"{h.get('num_key_value_heads')} KV, MLP {h.get('intermediate_size')}, random weights seed "
            f"{h.get('seed')}, SmolLM2's tokenizer)"
        )
    parts = []
    if "prompt_min" in c:
        parts.append(
            f"{c['requests']} requests (prompts {c['prompt_min']}-{c['prompt_max']} tokens, mean "
            f"{c['prompt_mean']:.0f}; outputs {c['output_min']}-{c['output_max']}, mean {c['output_mean']:.0f}; "
            f"{c['useful_tokens']} tokens)"
        )
    compared = c.get("reference_compared", {})
    checked = f"; greedy vs HF on {compared['burst']} burst requests" if "burst" in compared else ""
    return (
        f"{', '.join(parts) or 'runs'}: {', '.join(c.get('runs', ['burst', 'poisson']))}; {model} "
        f"{c.get('dtype', 'float32')}, greedy, EOS ignored{checked}; KV {c['kv_tokens']} tokens; "
        f"{c['threads']} threads each"
    )


def section_report(section: dict[str, Any]) -> str:
    results: list[EngineResult] = section["results"]
    c = section["config"]
    skipped = [f"  {r.engine}: skipped: {r.skipped}" for r in results if r.skipped]
    notes = [f"  {r.engine}: {'; '.join(r.notes)}" for r in results if not r.skipped and r.notes]
    parts = [_head(c), "", engines_table(results, c.get("rate", 1.0), c), ""]
    if "prefill" in c.get("runs", []):
        parts += [prefill_table(results, c), ""]
    if skipped:
        parts += ["skipped:", *skipped, ""]
    parts += ["notes:", *notes]
    if section.get("machine"):
        parts.append(f"  machine: {section['machine']}")
    shard = engines_by_key(section).get("shard")
    if "burst" in c.get("runs", ["burst"]) or (shard and shard.anatomies.get("single")):
        parts += ["", anatomy_table(shard, section.get("bare"), section.get("shape", {}))]
    if section.get("timings"):
        each = "; ".join(f"{label} {seconds:.0f} s" for label, seconds in section["timings"])
        parts += ["", f"time: {section.get('elapsed_s', 0):.0f} s ({each})"]
    return "\n".join(parts)


TITLES = {"smollm2": "SmolLM2", "hostbound": "the host-bound model", "prefill": "SmolLM2, time to first token"}


def _title(key: str) -> str:
    if key.startswith("hostbound-"):
        return f"the host-bound model, {key.removeprefix('hostbound-')} form"
    return TITLES.get(key, key)


def breadth_table(reports: list[dict[str, Any]]) -> str:
    """One row per model and dtype over several runs' reports (``--dtype float32 bfloat16``): the burst's tokens/s of
    this shard and vLLM, their ratio, and whether this shard's greedy tokens matched HF's."""
    rows = []
    for report in reports:
        for section in report.get("sections", []):
            c = section["config"]
            if "burst" not in c.get("runs", []):
                continue
            by = engines_by_key(section)
            shard, vllm = by.get("shard"), by.get("vllm")
            mine = shard.runs.get("burst") if shard else None
            theirs = vllm.runs.get("burst") if vllm else None
            ours, peer = (None if r is None else r.tokens_per_s for r in (mine, theirs))
            skipped = [r.engine for r in section["results"] if r.skipped]
            rows.append(
                [
                    _title(section.get("key", "")),
                    c.get("dtype", report.get("dtype", "float32")),
                    _f(ours, "{:.0f}"),
                    _f(peer, "{:.0f}"),
                    _ratio(ours, peer),
                    _match(mine),
                    ", ".join(skipped) or "-",
                ]
            )
    if not rows:
        return "breadth: no burst run (--scenarios burst or --models)"
    head = ["model", "dtype", "shard tok/s", "vLLM tok/s", "shard / vLLM", "shard greedy vs HF", "skipped"]
    return "\n".join(["breadth (burst, best round each; one row per model and dtype):", table(head, rows)])


def format_report(report: dict[str, Any]) -> str:
    """The whole run; an older one-section report (no ``sections``) reads as the SmolLM2 section."""
    sections = report.get("sections") or [{**report, "key": "smollm2"}]
    parts = []
    if report.get("host") is not None:
        parts += [describe(report["host"], report.get("dtype", "float32"))]
    if "repeats" in report:
        parts.append(
            f"{report['repeats']} round(s): this shard and vLLM alternate (shard, vLLM, shard, vLLM, ...), a fresh "
            "process each; per engine the best round is shown (highest tokens/s, lowest ITL), every round listed; "
            "the Poisson run and transformers' continuous batching run once"
        )
    for section in sections:
        runs = ", ".join(section["config"].get("runs", ["burst", "poisson"]))
        parts += [
            "",
            f"== {_title(section.get('key', ''))}: {runs} ==",
            section_report(section),
        ]
    parts += ["", goals_table(issue21_goals(report))]
    if "sections" in report and report.get("machine"):
        parts.append(f"machine: {report['machine']}")
    parts.append(f"(total {report['elapsed_s']:.0f} s)")
    return "\n".join(parts)
