"""The report's figure (PNG) and the JSON beside it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from integration.bench_e2e.report import E2EReport
from integration.bench_e2e.results import CONTIGUOUS, STOCK


def plot_report(report: E2EReport, path: str | Path) -> Path:
    from tgi_paged_backend.bench.plots import pyplot, save_figure

    plt = pyplot()
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
    return save_figure(fig, path)


def write_outputs(report: E2EReport, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "e2e.json"
    js.write_text(json.dumps(report.to_dict(), indent=2, default=str))
    return js, plot_report(report, out / "e2e.png")
