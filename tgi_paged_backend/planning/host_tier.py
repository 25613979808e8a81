"""What a host KV tier (``TGI_PAGED_HOST_CACHE_GB``, ``plan --host-cache-gb``) buys for a plan's trace.

The tier keeps prefix blocks the pool evicts, so a re-sent prompt (the next turn of a chat, a shared
document) loads them back instead of computing them again. The trace has no prefix identities, so the
estimate rests on one stated assumption:

- every request's prompt comes back once (its next turn), after the others: the working set is the
  trace's prompts in full blocks (only full blocks are cached), and a revisit finds a block still cached
  with probability ``min(1, cached tokens / working set)`` (uniform revisits; round robin over LRU is
  all-or-nothing instead: everything when the working set fits, nearly nothing when it does not);
- the pool caches what the running batch leaves free: its physical tokens x ``(1 - kv_used)`` of the
  simulated run at the advised overcommit; the tier adds ``bytes // (block bytes x KV layer groups)``
  blocks (each group's row of a position, as the shard's arena);
- TTFT of a mean revisit: one prefill step of the prompt (the plan's roofline) computing only the tokens
  no tier kept, plus the copy of those the host tier kept at the device's host-device bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tgi_paged_backend.planning.report import fmt_bytes
from tgi_paged_backend.planning.workload import TraceRequest

if TYPE_CHECKING:
    from tgi_paged_backend.planning.plan import Plan

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class HostTierEstimate:
    host_bytes: int
    host_blocks: int
    host_tokens: int
    """Extra prefix tokens the tier can keep (``host_blocks x block_size``)."""
    working_set_tokens: int
    """The trace's prompts in full blocks: what revisits could reuse."""
    pool_cache_tokens: int
    """What the pool keeps for prefixes beside the running batch."""
    kept_tokens_pool: int
    kept_tokens_tiered: int
    hit_rate_pool: float
    hit_rate_tiered: float
    mean_prompt_tokens: float
    ttft_pool_s: float
    ttft_tiered_s: float
    load_s_per_block: float
    prefill_s_per_block: float
    """A block's share of a compute-bound prefill (its FLOPs at the device's rate)."""

    @property
    def extra_kept_tokens(self) -> int:
        return self.kept_tokens_tiered - self.kept_tokens_pool

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "extra_kept_tokens": self.extra_kept_tokens}


def estimate_host_tier(plan: Plan, trace: Sequence[TraceRequest], host_gib: float) -> HostTierEstimate:
    """The estimate of the module doc for ``host_gib`` GiB of host tier beside ``plan``'s pool."""
    if not host_gib >= 0:
        raise ValueError(f"--host-cache-gb must be >= 0, got {host_gib}")
    bs = plan.inputs.block_size
    host_bytes = int(host_gib * GiB)
    row_bytes = plan.block_bytes * plan.groups.num_groups
    host_blocks = host_bytes // row_bytes if row_bytes else 0
    host_tokens = host_blocks * bs
    working = sum(r.prompt_tokens // bs * bs for r in trace)
    pool_cache = int(plan.physical_tokens * (1.0 - plan.comparison.best.kv_used))
    kept_pool = min(working, pool_cache)
    kept_tiered = min(working, pool_cache + host_tokens)
    hit_pool = kept_pool / working if working else 0.0
    hit_tiered = kept_tiered / working if working else 0.0
    cost = plan.sim_config.cost
    prompt = sum(r.prompt_tokens for r in trace) / len(trace) if trace else 0.0
    reusable = sum(r.prompt_tokens // bs * bs for r in trace) / len(trace) if trace else 0.0

    def ttft(pool_hits: float, host_hits: float) -> float:
        computed = max(1, round(prompt - pool_hits - host_hits))  # the last token is always computed
        copy = host_hits * plan.bytes_per_token / cost.swap_bytes_per_s
        return cost.step_s(context_tokens=prompt, computed_tokens=computed) + copy

    pool_hits = reusable * hit_pool
    host_hits = reusable * (hit_tiered - hit_pool)
    return HostTierEstimate(
        host_bytes=host_bytes,
        host_blocks=host_blocks,
        host_tokens=host_tokens,
        working_set_tokens=working,
        pool_cache_tokens=pool_cache,
        kept_tokens_pool=kept_pool,
        kept_tokens_tiered=kept_tiered,
        hit_rate_pool=hit_pool,
        hit_rate_tiered=hit_tiered,
        mean_prompt_tokens=prompt,
        ttft_pool_s=ttft(pool_hits, 0.0),
        ttft_tiered_s=ttft(pool_hits, host_hits),
        load_s_per_block=plan.block_bytes * plan.groups.num_groups / cost.swap_bytes_per_s,
        prefill_s_per_block=cost.flops_per_token * bs / cost.flops_per_s,
    )


def format_host_tier(e: HostTierEstimate, block_size: int) -> list[str]:
    """The plan's ``host tier`` lines."""

    def ms(s: float) -> str:
        return f"{1000 * s:.2f} ms"

    return [
        f"host tier    {fmt_bytes(e.host_bytes)} = {e.host_blocks:,} blocks = {e.host_tokens:,} prefix tokens beside "
        f"the pool's {e.pool_cache_tokens:,} (its physical tokens less the simulated batch's mean use)",
        f"{'':13}working set {e.working_set_tokens:,} tokens (every prompt re-sent once, full blocks): kept "
        f"{e.kept_tokens_pool:,} -> {e.kept_tokens_tiered:,} (+{e.extra_kept_tokens:,}); expected prefix hit rate "
        f"{100 * e.hit_rate_pool:.1f} % -> {100 * e.hit_rate_tiered:.1f} %",
        f"{'':13}TTFT of a mean revisit ({e.mean_prompt_tokens:.0f} tokens) {ms(e.ttft_pool_s)} -> "
        f"{ms(e.ttft_tiered_s)}; one {block_size}-token block: load {ms(e.load_s_per_block)} vs computing it "
        f"{ms(e.prefill_s_per_block)}"
        + (
            "; the prefill step is weight-bound at this length, hits save no time"
            if e.ttft_tiered_s >= e.ttft_pool_s
            else ""
        ),
        f"{'':13}assumes uniform revisits (hit = kept / working set); round robin over LRU is all-or-nothing",
    ]
