"""Text tables and number formats for the planner and the benchmarks (the PNG plots are in
:mod:`tgi_paged_backend.bench.plots`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tgi_paged_backend.planning.sim_results import Comparison, SimResult

SEED_CLAIMS = {
    "waste": "60-80 % -> < 4 %",
    "batch": "2-4x",
    "throughput": "~2x",
}
"""What the seed claimed, printed next to our measurements."""


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, first_width: int | None = None) -> str:
    """A plain aligned text table (first column left-aligned, the others right-aligned)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(str(h)), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    if first_width:
        widths[0] = max(widths[0], first_width)
    out = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for row in cells:
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(out)


def comparison_table(c: Comparison, *, time_unit: str = "steps") -> str:
    """The seed's comparison, with our numbers: contiguous vs stock TGI vs paged (advised overcommit)."""
    cols: list[SimResult] = [c.contiguous, c.stock, c.best]
    base, stock = c.contiguous, c.stock
    headers = ["", "contiguous", "stock TGI", f"paged (oc {c.chosen_overcommit:g})", "seed claim"]
    rows = [
        ["KV waste (share of pool, time avg)", *(pct(r.waste_total) for r in cols), SEED_CLAIMS["waste"]],
        [
            "  internal / reservation / external",
            *(
                f"{100 * r.waste_internal:.1f}/{100 * r.waste_reservation:.1f}/{100 * r.waste_external:.1f}"
                for r in cols
            ),
            "",
        ],
        ["KV holding written tokens", *(pct(r.kv_used) for r in cols), "20-38 % (vLLM paper)"],
        ["admitted concurrency mean / peak", *(f"{r.mean_admitted:.1f} / {r.peak_admitted}" for r in cols), ""],
        ["batch size (running) mean", *(f"{r.mean_running:.1f}" for r in cols), ""],
        ["batch size vs contiguous", *(ratio(r.mean_running, base.mean_running) for r in cols), SEED_CLAIMS["batch"]],
        ["batch size vs stock TGI", *(ratio(r.mean_running, stock.mean_running) for r in cols), ""],
        [
            f"throughput tok/{'step' if time_unit == 'steps' else time_unit}",
            *(f"{r.tokens_per_s:,.1f}" for r in cols),
            "",
        ],
        [
            "throughput vs contiguous",
            *(ratio(r.tokens_per_s, base.tokens_per_s) for r in cols),
            SEED_CLAIMS["throughput"],
        ],
        ["throughput vs stock TGI", *(ratio(r.tokens_per_s, stock.tokens_per_s) for r in cols), ""],
        ["requests queued mean / peak", *(f"{r.mean_queued:.0f} / {r.peak_queued}" for r in cols), ""],
        ["OOM-equivalent failures", *(str(r.failed) for r in cols), ""],
        ["fragmentation stalls (steps)", *(str(r.fragmentation_steps) for r in cols), ""],
        ["preemptions (recompute / swap)", *(f"{r.preemptions_recompute} / {r.preemptions_swap}" for r in cols), ""],
        ["recompute tax", *(pct(r.recompute_tax) for r in cols), ""],
        [f"TTFT p50 / p99 ({time_unit})", *(f"{r.ttft_p50_s:,.1f} / {r.ttft_p99_s:,.1f}" for r in cols), ""],
    ]
    return table(headers, rows)


def overcommit_table(c: Comparison) -> str:
    """The paged allocator at each simulated overcommit."""
    headers = [
        "overcommit",
        "tok/s",
        "vs stock",
        "batch mean",
        "admitted peak",
        "waste",
        "preempt r/s",
        "recompute tax",
        "TTFT p50",
        "",
    ]
    rows = []
    for oc, r in sorted(c.paged.items()):
        rows.append(
            [
                f"{oc:g}",
                f"{r.tokens_per_s:,.1f}",
                ratio(r.tokens_per_s, c.stock.tokens_per_s),
                f"{r.mean_running:.1f}",
                str(r.peak_admitted),
                pct(r.waste_total),
                f"{r.preemptions_recompute}/{r.preemptions_swap}",
                pct(r.recompute_tax),
                f"{r.ttft_p50_s:,.1f}",
                "<- advised" if oc == c.chosen_overcommit else "",
            ]
        )
    return table(headers, rows)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))
