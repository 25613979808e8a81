"""The KV tiers' lines of the demo's KV memory report, from the shard's last ``/metrics`` scrape.

One line per tier that is on (the ``tgi_paged_kv_*tier*`` families are absent when a tier is off): the
host tier's rows and the disk tier's files and bytes, each tier's prefix-hit tokens, the bytes moved each
way and the blocks it let go.
"""

from __future__ import annotations

from integration.prometheus_text import Samples

MiB = 2**20


def _by(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``name``'s samples by the value of ``label``, summed over its other labels."""
    out: dict[str, float] = {}
    for (metric, labels), value in samples.items():
        if metric == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def _dropped(samples: Samples, tier: str) -> str:
    reasons = {
        dict(labels)["reason"]: int(value)
        for (metric, labels), value in samples.items()
        if metric == "tgi_paged_kv_tier_dropped_blocks_total" and dict(labels).get("tier") == tier
    }
    return ", ".join(f"{reason} {n}" for reason, n in sorted(reasons.items())) or "none"


def tier_lines(samples: Samples) -> list[str]:
    """The report's tier lines (none when the shard has no tier below the pool)."""
    rows = _by(samples, "tgi_paged_kv_host_tier_rows", "state")
    if not rows:
        return []
    hits = _by(samples, "tgi_paged_kv_tier_hit_tokens_total", "tier")
    moved = _by(samples, "tgi_paged_kv_tier_moved_bytes_total", "direction")
    lines = [
        "KV tiers below the pool (prefix-hit tokens by tier: "
        + ", ".join(f"{t} {int(hits.get(t, 0))}" for t in ("pool", "host", "disk"))
        + "):",
        f"  host RAM: {int(rows.get('used', 0))} / {int(rows.get('total', 0))} rows used, "
        f"{moved.get('offload', 0) / MiB:.1f} MiB offloaded, {moved.get('load', 0) / MiB:.1f} MiB loaded back; "
        f"let go: {_dropped(samples, 'host')}",
    ]
    disk = _by(samples, "tgi_paged_kv_disk_tier_bytes", "state")
    if disk:
        files = int(samples.get(("tgi_paged_kv_disk_tier_files", ()), 0))
        lines.append(
            f"  disk: {files} files, {disk.get('used', 0) / MiB:.1f} / {disk.get('max', 0) / MiB:.1f} MiB, "
            f"{moved.get('spill', 0) / MiB:.1f} MiB written, {moved.get('fetch', 0) / MiB:.1f} MiB read; "
            f"let go: {_dropped(samples, 'disk')}"
        )
    return lines
