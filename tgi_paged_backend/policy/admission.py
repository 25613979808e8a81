"""Admission brake: stop the router from admitting while physical headroom is short.

The stock router admits new requests while ``max_batch_total_tokens - CachedBatch.max_tokens > 0``
and, with chunking, sizes new prefill work as ``max_batch_prefill_tokens - current_tokens`` (router
contract, section 7). So while braking, the shard reports ``max_tokens >= max_batch_total_tokens``
(and ``current_tokens >= max_batch_prefill_tokens`` when chunking); otherwise the true values.

Braking starts when free (including reclaimable retained) blocks fall below the watermark share of
the pool, and lasts as long as any preempted request waits to resume (preempted work goes first).
"""

from __future__ import annotations

from dataclasses import dataclass


def should_brake(num_free_blocks: int, num_total_blocks: int, watermark: float, num_waiting_preempted: int) -> bool:
    """Whether new admissions must stop now.

    Args:
        num_free_blocks: Blocks an allocation can draw on (free plus retained).
        num_total_blocks: Usable physical blocks.
        watermark: Share of the pool kept free for running requests, in ``[0, 1)``.
        num_waiting_preempted: Preempted requests not yet resumed.

    Returns:
        ``True`` while headroom is under the watermark or preempted requests wait.
    """
    assert 0 <= num_free_blocks <= num_total_blocks and 0.0 <= watermark < 1.0
    if num_waiting_preempted > 0:
        return True
    return num_free_blocks < watermark * num_total_blocks or num_free_blocks == 0


@dataclass(frozen=True, slots=True)
class BatchTokens:
    """``CachedBatch.max_tokens`` / ``current_tokens`` to report to the router."""

    max_tokens: int
    current_tokens: int


def reported_batch_tokens(
    *,
    braking: bool,
    max_tokens: int,
    current_tokens: int,
    max_batch_total_tokens: int,
    max_batch_prefill_tokens: int | None = None,
) -> BatchTokens:
    """The token figures a ``CachedBatch`` carries, inflated while braking.

    Args:
        braking: Result of :func:`should_brake`.
        max_tokens: The batch's true reserved tokens (what stock TGI reports).
        current_tokens: The batch's true current tokens.
        max_batch_total_tokens: The router's total budget (our Warmup answer).
        max_batch_prefill_tokens: The router's prefill budget when chunking is on, else ``None``.

    Returns:
        ``max_tokens >= max_batch_total_tokens`` (and ``current_tokens >= max_batch_prefill_tokens``
        with chunking) while braking; the true values otherwise.
    """
    if not braking:
        return BatchTokens(max_tokens, current_tokens)
    if max_batch_prefill_tokens is not None:
        current_tokens = max(current_tokens, max_batch_prefill_tokens)
    return BatchTokens(max(max_tokens, max_batch_total_tokens), current_tokens)
