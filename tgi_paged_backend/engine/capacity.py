"""Warmup arithmetic: physical pool size, the overcommitted budget and the request limits.

Pure functions, so the capacity rules are unit-tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from tgi_paged_backend.config import ConfigError
from tgi_paged_backend.memory.layer_groups import LayerGroups
from tgi_paged_backend.memory.window_reclaim import max_request_blocks


@dataclass(frozen=True, slots=True)
class Capacity:
    num_blocks: int
    """Physical blocks including the scratch block 0."""
    physical_tokens: int
    """Tokens the usable blocks hold."""
    max_supported_total_tokens: int
    """Advertised to the router: its virtual pool."""
    max_input_tokens: int
    max_total_tokens: int
    max_prefill_tokens: int
    """Server-side chunk budget, a multiple of the block size."""
    budget_gain: float = 1.0
    """With KV layer groups: how much further the pool goes for a ``max_total_tokens`` request than if
    every group kept every block (the advertised budget is multiplied by it)."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_capacity(
    *,
    available_kv_bytes: int,
    block_bytes: int,
    block_size: int,
    num_blocks_cap: int | None,
    overcommit: float,
    max_position_embeddings: int,
    max_input_tokens: int | None,
    max_total_tokens: int | None,
    max_prefill_tokens: int,
    reclaim_window: int | None = None,
    groups: LayerGroups | None = None,
) -> Capacity:
    """Size the pool and answer Warmup (``reclaim_window``: one request holds at most its window;
    ``groups``, when given, carry the windows instead, a single group's being that reclaim window).

    With KV layer groups (``groups``, more than one) a token position takes one block slot in every
    group that holds it, so ``physical_tokens`` is ``1 / num_groups`` of the blocks' positions (every
    group keeping every block), one request of ``max_total_tokens`` must fit at its peak (a sliding
    group holding its window plus a prefill chunk: ``LayerGroups.request_blocks``), and the router's
    budget grows by what the sliding groups no longer hold once a request of that length has decoded to
    its end: ``num_groups * ceil(T / block_size) / sum(final_blocks(T))`` (:attr:`Capacity.budget_gain`).
    The gain counts the steady state, not the peak: a sliding group holds more than its final blocks only
    while a prefill chunk (first prefill, or recompute) reads its window, and a step prefills at most
    ``max_prefill_tokens`` over all requests; with the peak, the TGI default of 4096-token chunks would
    erase the gain of Gemma 2's 4096-token windows. Shorter requests gain less, and transient peaks
    happen; the admission brake and preemption absorb both. A single windowed group (every layer
    sliding) gets no gain, as before groups.

    Raises:
        ConfigError: one ``max_total_tokens`` request cannot fit physically, or limits contradict.
    """
    num_blocks = available_kv_bytes // block_bytes
    if num_blocks_cap is not None:
        num_blocks = min(num_blocks, num_blocks_cap)
    num_groups = 1 if groups is None else groups.num_groups
    physical_tokens = max(num_blocks - 1, 0) // num_groups * block_size
    if max_total_tokens is None:
        # 0: the config names no limit (Bloom: ALiBi positions extend as far as the pool)
        max_total_tokens = min(physical_tokens, max_position_embeddings or physical_tokens)
        if max_input_tokens is not None:
            max_total_tokens = max(max_total_tokens, max_input_tokens + 1)
    if max_input_tokens is None:
        max_input_tokens = max_total_tokens - 1
    if max_input_tokens >= max_total_tokens or max_input_tokens < 1:
        raise ConfigError(f"max_input_tokens={max_input_tokens} must be in [1, max_total_tokens={max_total_tokens})")
    max_prefill_tokens = round_up(max(max_prefill_tokens, 1), block_size)
    needed_blocks = 1 + (
        groups.request_blocks(max_total_tokens, block_size, max_prefill_tokens)
        if groups is not None
        else max_request_blocks(max_total_tokens, block_size, reclaim_window, max_prefill_tokens)
    )
    if needed_blocks > num_blocks:
        raise ConfigError(
            f"one request of max_total_tokens={max_total_tokens} needs {needed_blocks} KV blocks "
            f"(block size {block_size}, incl. the scratch block) but the pool holds {num_blocks}: "
            "raise TGI_PAGED_NUM_BLOCKS or TGI_PAGED_MEMORY_FRACTION (CUDA_MEMORY_FRACTION), or lower "
            "--max-total-tokens"
        )
    gain = 1.0
    if groups is not None and groups.num_groups > 1:
        full = groups.num_groups * -(-max_total_tokens // block_size)
        gain = max(1.0, full / sum(groups.final_blocks(max_total_tokens, block_size)))
    virtual_tokens = int(physical_tokens * gain * overcommit) // block_size * block_size
    advertised = max(virtual_tokens, round_up(max_total_tokens, block_size), max_prefill_tokens)
    return Capacity(
        num_blocks=num_blocks,
        physical_tokens=physical_tokens,
        max_supported_total_tokens=advertised,
        max_input_tokens=max_input_tokens,
        max_total_tokens=max_total_tokens,
        max_prefill_tokens=max_prefill_tokens,
        budget_gain=gain,
    )
