"""What sliding-window block reclaim saves on long requests, simulated through the real manager.

:func:`simulate_long_run` admits ``num_requests`` identical requests at once and steps them as the
engine's scheduler does (prompts in chunks of the per-step prefill budget, then one token per step
each) through :class:`~tgi_paged_backend.memory.KVCacheManager` on a pool big enough that nothing is
preempted, and records the peak of physical blocks in use. :func:`compare_reclaim` runs it with the
reclaim window the engine would use for the model's layers
(:func:`~tgi_paged_backend.memory.window_reclaim.reclaim_window`) and without one. For models that
mix sliding and full layers, one page map reclaims nothing (0 saved); :func:`hybrid_pool_saving` gives
what one page map per layer group saves analytically, and the run with the engine's KV layer groups
(``KVCacheManager(groups=...)``) measures it, in bytes (a grouped block holds fewer layers). No model, no
torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tgi_paged_backend.memory import KVCacheManager
from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.memory.window_reclaim import hybrid_pool_saving, reclaim_window


@dataclass(frozen=True, slots=True)
class LongRunPeak:
    """Peak pool occupancy of one simulated run."""

    window: int | None
    """The manager's reclaim window (``None``: every block kept)."""
    peak_blocks: int
    """Most physical blocks in use at once, all requests together."""
    peak_request_blocks: int
    """Most physical blocks one request held at once."""
    num_reclaimed_blocks: int
    """Blocks given back behind the window over the run."""
    end_blocks: int = 0
    """Physical blocks in use after the last step (every request at its full length)."""


def simulate_long_run(
    *,
    num_requests: int,
    prompt_tokens: int,
    output_tokens: int,
    block_size: int,
    window: int | None,
    max_prefill_tokens: int,
    groups: Sequence[int | None] | None = None,
) -> LongRunPeak:
    """Step ``num_requests`` requests of ``prompt_tokens + output_tokens`` to the end; see module doc.

    ``groups``: KV layer groups' windows instead of ``window`` (one page map per group, the engine's
    layout for models mixing sliding and full layers; a block then holds one group's layers).
    As in TGI, the last generated token's K/V is never written: each request writes
    ``prompt_tokens + output_tokens - 1`` positions.
    """
    total = prompt_tokens + output_tokens - 1
    num_groups = 1 if groups is None else len(groups)
    num_blocks = num_requests * num_groups * -(-total // block_size) + 1
    layout = {"groups": tuple(groups)} if groups is not None else {"reclaim_window": window}
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_retention=False, **layout)
    computed = [0] * num_requests
    held = [0] * num_requests
    for rid in range(num_requests):
        kv.add_request(rid)
        kv.match_prefix(rid, [rid] * prompt_tokens)
    peak = peak_request = reclaimed = 0
    while any(c < total for c in computed):
        budget = max_prefill_tokens
        for rid in range(num_requests):
            if computed[rid] >= total:
                continue
            n = 1 if computed[rid] >= prompt_tokens else min(prompt_tokens - computed[rid], budget)
            if n == 0:
                continue
            if computed[rid] < prompt_tokens:
                budget -= n
            allocation = kv.allocate(rid, computed[rid] + n)
            assert allocation is not None, "the pool is sized for every block"
            computed[rid] += n
            now = kv.stats().num_reclaimed_blocks_total
            held[rid] += len(allocation.new_blocks) - (now - reclaimed)  # this call's reclaim is rid's
            reclaimed = now
            peak_request = max(peak_request, held[rid])
        peak = max(peak, kv.num_used_blocks)
    return LongRunPeak(window, peak, peak_request, reclaimed, kv.num_used_blocks)


@dataclass(frozen=True, slots=True)
class ReclaimComparison:
    """One model's layers on one workload: peaks with the engine's reclaim and with none."""

    label: str
    with_reclaim: LongRunPeak
    without: LongRunPeak
    hybrid_saving: float
    """Share of the KV that per-layer-group pools would free at the longest request length."""
    grouped: LongRunPeak | None = None
    """The run with the engine's KV layer groups (models mixing sliding and full layers only)."""
    layers_per_block: int = 0
    """Layers one block holds with those groups (all layers without)."""
    num_layers: int = 0
    final_request_blocks: int = 0
    """With groups: the blocks one request holds at its end by the groups' arithmetic
    (:meth:`LayerGroups.final_blocks`, summed over groups), to set beside the measured ones."""
    num_requests: int = 1

    @property
    def measured_final_request_blocks(self) -> float | None:
        """With groups: the blocks one request holds at its end, measured (all requests' over their count)."""
        return None if self.grouped is None else self.grouped.end_blocks / self.num_requests

    @property
    def grouped_saving(self) -> tuple[float, float] | None:
        """Share of the KV bytes the layer groups save against one page map for all layers: (at the peak,
        at the end). ``None`` without groups."""
        if self.grouped is None:
            return None
        ratio = self.layers_per_block / self.num_layers
        peak = 1.0 - self.grouped.peak_blocks * ratio / max(self.without.peak_blocks, 1)
        end = 1.0 - self.grouped.end_blocks * ratio / max(self.without.end_blocks, 1)
        return peak, end

    @property
    def ratio(self) -> float:
        """Peak blocks without reclaim over peak blocks with it (1.0: nothing saved)."""
        return self.without.peak_blocks / max(self.with_reclaim.peak_blocks, 1)

    @property
    def saving(self) -> float:
        """Share of the peak KV that reclaim saves."""
        return 1.0 - self.with_reclaim.peak_blocks / max(self.without.peak_blocks, 1)


def compare_reclaim(
    label: str,
    layer_windows: Sequence[int | None],
    *,
    num_requests: int,
    prompt_tokens: int,
    output_tokens: int,
    block_size: int = 16,
    max_prefill_tokens: int = 4096,
) -> ReclaimComparison:
    """Peaks with the reclaim the engine applies for ``layer_windows`` (each layer's window, ``None``
    for a full layer) and without reclaim, plus the hybrid-pool saving for comparison."""
    windows = [w for w in layer_windows if w is not None]
    window = reclaim_window(windows[0] if windows else None, layer_windows)

    def run(window: int | None, groups: Sequence[int | None] | None = None) -> LongRunPeak:
        return simulate_long_run(
            num_requests=num_requests,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            block_size=block_size,
            window=window,
            max_prefill_tokens=max_prefill_tokens,
            groups=groups,
        )

    groups = LayerGroups.from_layer_windows(layer_windows)
    total = prompt_tokens + output_tokens - 1
    return ReclaimComparison(
        label,
        run(window),
        run(None),
        hybrid_pool_saving(layer_windows, total, block_size),
        run(None, groups.windows) if groups.is_hybrid else None,
        groups.layers_per_block,
        len(layer_windows),
        sum(groups.final_blocks(total, block_size)),
        num_requests,
    )


def format_comparisons(rows: Sequence[ReclaimComparison], *, block_bytes: dict[str, int] | None = None) -> str:
    """A markdown table of :func:`compare_reclaim` results (``block_bytes``: label -> bytes per block)."""
    lines = [
        "| model layers | reclaim window | peak blocks, no reclaim | peak blocks, reclaim | ratio | "
        "KV saved | per request (no reclaim -> reclaim) | per-layer-group pools, at the end (analytic) | "
        "layer groups, measured: KV saved at the peak; at the end | "
        "layer groups: blocks a request holds at the end, measured / by the groups' arithmetic |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_request = f"{r.without.peak_request_blocks} -> {r.with_reclaim.peak_request_blocks} blocks"
        if block_bytes and r.label in block_bytes:
            gib = block_bytes[r.label] / 2**30
            per_request += (
                f" ({r.without.peak_request_blocks * gib:.2f} -> {r.with_reclaim.peak_request_blocks * gib:.2f} GiB)"
            )
        window = "none (mixed layers)" if r.with_reclaim.window is None else str(r.with_reclaim.window)
        measured = r.grouped_saving
        groups = "-" if measured is None else f"{measured[0]:.0%}; {measured[1]:.1%}"
        final = r.measured_final_request_blocks
        blocks = "-" if final is None else f"{final:,g} / {r.final_request_blocks:,}"
        lines.append(
            f"| {r.label} | {window} | {r.without.peak_blocks:,} | {r.with_reclaim.peak_blocks:,} | "
            f"{r.ratio:.2f}x | {r.saving:.0%} | {per_request} | {r.hybrid_saving:.1%} | {groups} | {blocks} |"
        )
    return "\n".join(lines)


LONG_RUN_MODELS: dict[str, tuple[list[int | None], int]] = {
    # name: (each layer's window, None for a full layer; K+V bytes per token at bf16)
    "Mistral-7B-v0.1": ([4096] * 32, 2 * 32 * 8 * 128 * 2),
    "Gemma-2-9B": ([4096, None] * 21, 2 * 42 * 8 * 256 * 2),
    "Gemma-3-27B": (([1024] * 5 + [None]) * 10 + [1024] * 2, 2 * 62 * 16 * 128 * 2),
    "gpt-oss-20b": ([128, None] * 12, 2 * 24 * 8 * 64 * 2),
}
"""Layer patterns and KV sizes of the published configs (32 / 42 / 62 layers)."""

LONG_RUN_WORKLOADS: tuple[tuple[str, int, int, int], ...] = (
    ("Mistral-7B-v0.1", 8, 8192, 8192),
    ("Mistral-7B-v0.1", 4, 1024, 31744),
    ("Mistral-7B-v0.1", 8, 1024, 1024),
    ("Gemma-2-9B", 8, 4096, 4096),
    ("Gemma-3-27B", 4, 8192, 8192),
    ("gpt-oss-20b", 8, 4096, 4096),
)
"""``(model, requests, prompt tokens, output tokens)``: long prompts, long generations, a short control."""


def long_run_table(*, block_size: int = 16, max_prefill_tokens: int = 4096) -> str:
    """The figure of ``docs/models.md``: :data:`LONG_RUN_WORKLOADS` through :func:`compare_reclaim`."""
    rows, block_bytes = [], {}
    for model, num_requests, prompt, output in LONG_RUN_WORKLOADS:
        layers, bytes_per_token = LONG_RUN_MODELS[model]
        label = f"{model}, {num_requests} x ({prompt:,} + {output:,})"
        rows.append(
            compare_reclaim(
                label,
                layers,
                num_requests=num_requests,
                prompt_tokens=prompt,
                output_tokens=output,
                block_size=block_size,
                max_prefill_tokens=max_prefill_tokens,
            )
        )
        block_bytes[label] = bytes_per_token * block_size
    return format_comparisons(rows, block_bytes=block_bytes)
