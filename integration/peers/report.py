"""The side-by-side table, the step anatomy beside the bare forward, and the issue-14 goals."""

from __future__ import annotations

import math
from typing import Any

from integration.peers.jobs import EngineResult, RunFigures
from tgi_paged_backend.bench.report import table
from tgi_paged_backend.telemetry.step_record import STEP_PARTS


def _f(value: float, fmt: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def _match(run: RunFigures | None) -> str:
    if run is None or run.matched is None:
        return "n/a"
    text = f"{run.matched}/{run.compared}"
    return text + (" identical" if run.matched == run.compared else f" (first: {run.first_mismatch})")


def engines_table(results: list[EngineResult], rate: float) -> str:
    ran = [r for r in results if not r.skipped]
    headers = ["", *(r.engine for r in ran)]

    def row(label: str, fn) -> list[str]:
        return [label, *(fn(r) for r in ran)]

    rows = []
    for name, title in (("burst", "burst"), ("poisson", f"poisson {rate:g}/s")):

        def run(r: EngineResult, name=name) -> RunFigures | None:
            return r.runs.get(name)

        rows += [
            row(f"{title}: tokens/s", lambda r, run=run: _f(run(r).tokens_per_s, "{:.1f}") if run(r) else "n/a"),
            row(
                "  TTFT p50 / p99 s",
                lambda r, run=run: f"{run(r).ttft_p50_s:.2f} / {run(r).ttft_p99_s:.2f}" if run(r) else "n/a",
            ),
            row(
                "  ITL p50 / p99 s",
                lambda r, run=run: f"{run(r).itl_p50_s:.3f} / {run(r).itl_p99_s:.3f}" if run(r) else "n/a",
            ),
            row("  wall s", lambda r, run=run: _f(run(r).wall_s, "{:.1f}") if run(r) else "n/a"),
            row("  greedy tokens vs HF", lambda r, run=run: _match(run(r))),
        ]
    rows += [
        row("peak memory (RSS) GiB", lambda r: f"{r.peak_rss_bytes / 2**30:.2f}" if r.peak_rss_bytes else "n/a"),
        row("setup s (load + warm-up)", lambda r: f"{r.setup_s:.0f}"),
    ]
    return table(headers, rows)


def anatomy_table(shard: EngineResult | None, bare: dict[str, Any] | None, shape: dict[str, Any]) -> str:
    if shard is None or not shard.anatomy or not shard.anatomy.get("step"):
        return "step anatomy: no decode step measured (shard not run, or it exports no tgi_paged_step_part_seconds)"
    a = shard.anatomy
    total = sum(a[p] for p in STEP_PARTS)
    lines = [
        f"step anatomy (this shard, burst run; mean per decode step over {shape.get('decode_steps', '?')} steps; "
        f"mean running batch {shape.get('batch')}, context {shape.get('context')} tokens):"
    ]
    rows = [[p, f"{1000 * a[p]:.2f}", f"{100 * a[p] / total:.1f} %" if total else "n/a"] for p in STEP_PARTS]
    rows.append(["sum of parts", f"{1000 * total:.2f}", "100.0 %"])
    rows.append(["step (tgi_paged_step_seconds)", f"{1000 * a['step']:.2f}", ""])
    lines.append(table(["part", "ms", "share"], rows))
    if bare:
        fwd, limit = a["forward"], bare["forward_s"]
        overhead = total - limit
        lines.append(
            f"bare forward (the HF model alone: {bare['batch']} rows x {bare['context']} cached tokens, one "
            f"decode step, DynamicCache, same threads, same run): {1000 * limit:.2f} ms "
            f"(min {1000 * bare['min_s']:.2f})"
        )
        lines.append(
            f"  engine forward / bare forward: {fwd / limit:.2f}x; engine overhead (step - bare forward): "
            f"{1000 * overhead:.2f} ms = {100 * overhead / total:.1f} % of the step"
        )
    else:
        lines.append("bare forward: not measured")
    return "\n".join(lines)


def goals(results: list[EngineResult], bare: dict[str, Any] | None) -> str:
    by = {r.engine.split(" ")[0]: r for r in results if not r.skipped}
    shard, vllm = by.get("this"), by.get("vllm")
    lines = ["issue-14 goals (report only):"]

    def check(name: str, ok: bool | None, detail: str) -> None:
        lines.append(f"  {name:52s} {detail:28s} {'n/a' if ok is None else 'met' if ok else 'NOT met'}")

    if shard and vllm and "burst" in shard.runs and "burst" in vllm.runs:
        ratio = shard.runs["burst"].tokens_per_s / vllm.runs["burst"].tokens_per_s
        check("tokens/s vs vLLM CPU, burst (>= 1.0x, aim 1.5x)", ratio >= 1.0, f"{ratio:.2f}x")
        s, v = shard.runs.get("poisson"), vllm.runs.get("poisson")
        if s and v:
            check(
                "Poisson TTFT p99 no worse than vLLM",
                s.ttft_p99_s <= v.ttft_p99_s,
                f"{s.ttft_p99_s:.2f} s vs {v.ttft_p99_s:.2f} s",
            )
            check(
                "Poisson ITL p99 no worse than vLLM",
                s.itl_p99_s <= v.itl_p99_s,
                f"{s.itl_p99_s:.3f} s vs {v.itl_p99_s:.3f} s",
            )
    else:
        check("tokens/s vs vLLM CPU, burst", None, "vLLM not run")
    if shard and shard.anatomy.get("step") and bare:
        total = sum(shard.anatomy[p] for p in STEP_PARTS)
        share = (total - bare["forward_s"]) / total
        check(f"engine overhead < 10 % of the step (batch {bare['batch']})", share < 0.10, f"{100 * share:.1f} %")
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    results: list[EngineResult] = report["results"]
    c = report["config"]
    head = (
        f"{c['requests']} requests (prompts {c['prompt_min']}-{c['prompt_max']} tokens, mean "
        f"{c['prompt_mean']:.0f}; outputs {c['output_min']}-{c['output_max']}, mean {c['output_mean']:.0f}; "
        f"{c['useful_tokens']} tokens), burst and Poisson {c['rate']:g}/s; {c['model']} float32, greedy, EOS "
        f"ignored; KV {c['kv_tokens']} tokens; {c['threads']} threads each; engines one after another"
    )
    skipped = [f"  {r.engine}: skipped: {r.skipped}" for r in results if r.skipped]
    notes = [f"  {r.engine}: {'; '.join(r.notes)}" for r in results if not r.skipped and r.notes]
    parts = [head, "", engines_table(results, c["rate"]), ""]
    if skipped:
        parts += ["skipped:", *skipped, ""]
    parts += [
        "notes:",
        *notes,
        f"  machine: {report['machine']}",
        "",
        anatomy_table(
            next((r for r in results if r.engine.startswith("this") and not r.skipped), None),
            report.get("bare"),
            report.get("shape", {}),
        ),
        "",
        goals(results, report.get("bare")),
        "",
        f"(total {report['elapsed_s']:.0f} s)",
    ]
    return "\n".join(parts)
