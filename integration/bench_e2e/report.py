"""The report of every mode: the overcommit recommendation, the text table and the targets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from integration.bench_e2e.results import CONTIGUOUS, STOCK, ModeResult
from tgi_paged_backend.config import DEFAULT_OVERCOMMIT
from tgi_paged_backend.planning.sim_results import pick_overcommit


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


def format_report(report: E2EReport) -> str:
    from tgi_paged_backend.planning.report import pct, ratio, table

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
