"""What the replayed router knows about itself: derived limits (``RouterInfo``) and counters (``RouterStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RouterInfo:
    """Limits derived from ``Warmup`` plus the shard's ``Info`` answer (last shard)."""

    max_batch_total_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_size: int | None
    waiting_served_ratio: float
    max_waiting_tokens: int
    max_concurrent_requests: int
    max_supported_total_tokens: int | None
    """The raw ``WarmupResponse`` value (``None`` for legacy shards)."""
    num_blocks: int
    """``floor(max_batch_total_tokens / block_size)``; block 0 is never handed out."""
    requires_padding: bool
    dtype: str
    device_type: str
    window_size: int | None
    speculate: int
    support_chunking: bool
    use_prefix_caching: bool
    attention_impl: str
    block_size: int
    shard_urls: tuple[str, ...]


@dataclass
class RouterStats:
    """Counters of the replayed router (runtime RPCs only; startup RPCs are in ``router.rpc_log``)."""

    prefill_calls: int = 0
    decode_calls: int = 0
    filter_batch_calls: int = 0
    clear_cache_calls: int = 0
    prefill_failures: int = 0
    decode_failures: int = 0
    health_calls: int = 0
    liveness_calls: int = 0
    requests_scheduled: int = 0
    """Entries appended to the queue (continuation legs included)."""
    continuation_legs: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_dropped: int = 0
    """Entries removed at a Generation because their client had gone away."""
    requests_dropped_at_pop: int = 0
    """Entries the queue dropped when popping them because their client had gone away."""
    requests_incomplete: int = 0
    """Entries the batching loop let go without a final generation."""
    overloaded: int = 0
    validation_errors: int = 0
    concurrency_peak: int = 0
    """Most live entries the batching loop held at once (the admitted concurrency)."""
    queue_peak: int = 0
    queue_length: int = 0
    queue_blocked_on_kv: bool = False
    """Entries wait and the last admission attempt stopped on the KV budget (token budget spent or
    no blocks for the head): waiting for memory, as opposed to the prefill budget or batch size."""
    batch_concat: dict[str, int] = field(default_factory=dict)
    """Onboardings into a running batch by reason: backpressure, wait_exceeded, chunking."""
