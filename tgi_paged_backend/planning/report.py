"""Text tables and PNG plots for the benchmarks and the planner (matplotlib is imported lazily)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tgi_paged_backend.planning.allocator_sim import Comparison, SimResult

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
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
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


# ------------------------------------------------------------------------------------------- plots
def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # only the PNG plots need it; every text report works without
        raise RuntimeError("PNG plots need matplotlib: pip install 'tgi-paged-backend[bench]'") from err

    return plt


COLORS = {"contiguous": "#d62728", "stock": "#ff7f0e", "paged": "#2ca02c"}


def plot_comparison(c: Comparison, path: str | Path, *, title: str, time_unit: str = "steps") -> Path:
    """Four panels: batch size over time, queue over time, waste split, overcommit sweep."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    runs = [("contiguous", c.contiguous), ("stock TGI", c.stock), (f"paged (oc {c.chosen_overcommit:g})", c.best)]
    ax = axes[0][0]
    for (label, r), color in zip(runs, COLORS.values()):
        ax.plot(r.series["t"], r.series["running"], label=label, color=color, lw=1.2)
    ax.set_title("requests computing per step (batch size)")
    ax.set_xlabel(f"time ({time_unit})")
    ax.legend()
    ax = axes[0][1]
    for (label, r), color in zip(runs, COLORS.values()):
        ax.plot(r.series["t"], r.series["queued"], label=label, color=color, lw=1.2)
    ax.set_title("requests queued at the router")
    ax.set_xlabel(f"time ({time_unit})")
    ax.legend()
    ax = axes[1][0]
    names = [label for label, _ in runs]
    bottoms = [0.0] * len(runs)
    for kind, color in (
        ("kv_used", "#1f77b4"),
        ("waste_internal", "#9467bd"),
        ("waste_reservation", "#8c564b"),
        ("waste_external", "#7f7f7f"),
    ):
        values = [100 * getattr(r, kind) for _, r in runs]
        label = kind.replace("waste_", "waste: ").replace("kv_used", "written K/V")
        ax.bar(names, values, bottom=bottoms, color=color, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, (_, r) in enumerate(runs):
        ax.text(i, bottoms[i] + 1, f"waste {100 * r.waste_total:.1f} %", ha="center")
    ax.set_ylabel("% of the KV pool (time average)")
    ax.set_ylim(0, 110)
    ax.set_title("KV memory: written vs waste")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=4, fontsize=8)
    ax = axes[1][1]
    ocs = sorted(c.paged)
    ax.plot(
        ocs,
        [c.paged[o].tokens_per_s / c.stock.tokens_per_s for o in ocs],
        "o-",
        color=COLORS["paged"],
        label="paged throughput / stock TGI",
    )
    ax.axhline(
        c.contiguous.tokens_per_s / c.stock.tokens_per_s,
        color=COLORS["contiguous"],
        ls="--",
        label="contiguous / stock TGI",
    )
    ax.axvline(c.chosen_overcommit, color="k", ls=":", label=f"advised {c.chosen_overcommit:g}")
    ax.set_xlabel("TGI_PAGED_OVERCOMMIT")
    ax.set_ylabel("throughput ratio")
    ax2 = ax.twinx()
    ax2.plot(ocs, [100 * c.paged[o].recompute_tax for o in ocs], "s--", color="#9467bd", label="recompute tax %")
    ax2.set_ylabel("recompute tax (%)")
    ax2.set_ylim(0, max(10.0, 120 * max(c.paged[o].recompute_tax for o in ocs)))
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="lower right")
    ax.set_title("overcommit sweep")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))
