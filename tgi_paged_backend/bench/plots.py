"""PNG plots of the benchmarks (matplotlib is imported lazily: only the plots need the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tgi_paged_backend.planning.sim_results import Comparison


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
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
    plt = pyplot()
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
    return save_figure(fig, path)


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` as a PNG (parent folders made), close it; returns the path."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
