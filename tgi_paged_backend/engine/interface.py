"""The engine as the gRPC servicer sees it: one method per RPC, dataclasses in and out.

Calls are serialised by the servicer (one at a time). Bad input raises
:class:`~tgi_paged_backend.engine.types.InvalidRequestError` (or ``BatchNotFoundError``) before any
state changes.

Failure contract: a failed ``Prefill`` or ``Decode`` frees everything it was handed (the new batch and
the cached batches), since the router fails all of their requests (it runs with chunking, so a failed
Prefill fails the running batch too): none of them keeps a block, a swap slot, a prefix pin or a place
among the preempted.
"""

from __future__ import annotations

from typing import Protocol

from tgi_paged_backend.engine.types import (
    BatchSpec,
    CachedBatchInfo,
    InfoResult,
    StepResult,
    WarmupResult,
)


class ShardEngine(Protocol):
    def info(self) -> InfoResult:
        """``Info``: fixed before Warmup."""
        ...

    def warmup(
        self, batch: BatchSpec, *, max_input_tokens: int | None, max_prefill_tokens: int, max_total_tokens: int | None
    ) -> WarmupResult:
        """``Warmup``: profile, size the physical pool, answer the (overcommitted) budget."""
        ...

    def prefill(self, batch: BatchSpec, cached_batch_id: int | None) -> StepResult:
        """``Prefill``: add ``batch`` (merged with the cached batch when given) and run one step."""
        ...

    def decode(self, batch_ids: list[int]) -> StepResult:
        """``Decode``: merge the cached batches (first id wins) and run one step."""
        ...

    def filter_batch(self, batch_id: int, request_ids: list[int]) -> CachedBatchInfo:
        """``FilterBatch``: keep only ``request_ids``; release everything else's memory."""
        ...

    def release_batches(self, batch_ids: list[int]) -> None:
        """Free the requests of these cached batches after a call that failed before reaching the
        engine (say, a Prefill whose new batch could not be converted); unknown ids are ignored."""
        ...

    def clear_cache(self, batch_id: int | None) -> None:
        """``ClearCache``: drop one batch (unknown ids succeed) or all of them."""
        ...

    def health(self) -> None:
        """``Health``: touch the device; raise if it is broken."""
        ...
