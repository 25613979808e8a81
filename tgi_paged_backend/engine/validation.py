"""Checks on router input, run before any state changes.

Each failure raises :class:`InvalidRequestError` with a message naming the request and the problem;
the servicer maps it to gRPC ``INVALID_ARGUMENT`` and every other request keeps being served.
"""

from __future__ import annotations

from collections.abc import Sequence

from tgi_paged_backend.engine.types import U64_MAX, BatchSpec, InvalidRequestError, RequestSpec
from tgi_paged_backend.vision.attend_spans import longest_span_reason


def validate_batch(batch: BatchSpec, *, live_ids: set[int], num_virtual_blocks: int, probe: bool = False) -> None:
    """Batch-level checks: non-empty, no duplicate ids, none already live, per-request checks. What the router
    keeps for its liveness probe (request id ``U64_MAX``, virtual block 0, which the shard backs with its
    scratch block) only the probe (``probe``) may use: two requests on block 0 would read each other's KV."""
    if not batch.requests:
        raise InvalidRequestError(f"batch {batch.id} has no requests")
    seen: set[int] = set()
    for request in batch.requests:
        if request.id in seen:
            raise InvalidRequestError(f"batch {batch.id}: duplicate request id {request.id}")
        if request.id in live_ids:
            raise InvalidRequestError(f"batch {batch.id}: request id {request.id} is already in a cached batch")
        seen.add(request.id)
        validate_request_spec(request, num_virtual_blocks=num_virtual_blocks)
        if not probe and request.id == U64_MAX:
            raise InvalidRequestError(f"batch {batch.id}: request id {U64_MAX} is the router's liveness probe's")
        if not probe and 0 in request.blocks:
            raise InvalidRequestError(
                f"request {request.id}: block 0 is reserved for the router's liveness probe (the shard's scratch block)"
            )


def validate_request_spec(request: RequestSpec, *, num_virtual_blocks: int) -> None:
    """Checks that need no tokenization."""
    rid = request.id
    if not request.text:
        raise InvalidRequestError(f"request {rid}: no text input")
    if request.truncate < 1:
        raise InvalidRequestError(f"request {rid}: truncate must be >= 1, got {request.truncate}")
    if request.stopping.max_new_tokens < 1:
        raise InvalidRequestError(f"request {rid}: max_new_tokens must be >= 1")
    if request.chunk_len is not None and request.chunk_len < 1:
        raise InvalidRequestError(f"request {rid}: chunk_len must be >= 1 when set, got {request.chunk_len}")
    if request.cache_len < 0:
        raise InvalidRequestError(f"request {rid}: cache_len must be >= 0")
    if request.blocks:
        if len(set(request.blocks)) != len(request.blocks):
            raise InvalidRequestError(f"request {rid}: a block id appears twice in its blocks")
        bad = [b for b in request.blocks if not 0 <= b < num_virtual_blocks]
        if bad:
            raise InvalidRequestError(
                f"request {rid}: block id {bad[0]} outside the advertised range [0, {num_virtual_blocks})"
            )


def validate_tokenized(
    request: RequestSpec, prompt_ids: Sequence[int], *, block_size: int, max_input_tokens: int | None, slack: int = 0
) -> None:
    """Checks against the server's own tokenization of the prompt. ``slack``: tokens the shard's prompt may hold past
    the router's reservation (PaliGemma's server-side ``<bos>`` + text + ``\n`` wrap, which stock's router does not
    count): the page map backs them with pool blocks past the router's, as any overcommit."""
    rid = request.id
    num_prompt = len(prompt_ids)
    if num_prompt == 0:
        raise InvalidRequestError(f"request {rid}: the prompt tokenizes to no tokens")
    if max_input_tokens is not None and num_prompt > max_input_tokens:
        raise InvalidRequestError(
            f"request {rid}: prompt has {num_prompt} tokens, more than max_input_tokens={max_input_tokens}"
        )
    if request.cache_len >= num_prompt:
        raise InvalidRequestError(f"request {rid}: cache_len={request.cache_len} must be < prompt length {num_prompt}")
    if request.blocks or request.slots:
        needed = num_prompt + request.stopping.max_new_tokens - 1
        if len(request.slots) < needed - slack:
            raise InvalidRequestError(
                f"request {rid}: {len(request.slots)} slots for {needed} tokens to write "
                f"(prompt {num_prompt} + max_new_tokens {request.stopping.max_new_tokens} - 1); "
                "router and shard tokenizers may disagree (or, with images, the router's image-token count is "
                "below the shard's own: stock's router budgets Idefics3 with fixed tiles)"
            )
        capacity = len(request.blocks) * block_size
        if capacity < needed - slack:
            raise InvalidRequestError(
                f"request {rid}: {len(request.blocks)} blocks hold {capacity} tokens, {needed} needed"
            )
        bad = next(
            (i for i, s in enumerate(request.slots[:needed]) if s // block_size != request.blocks[i // block_size]),
            None,
        )
        if bad is not None:
            raise InvalidRequestError(
                f"request {rid}: slot {request.slots[bad]} at position {bad} is not in block "
                f"{request.blocks[bad // block_size]} (slot = block * {block_size} + offset)"
            )


def validate_fits_pool(request: RequestSpec, num_prompt: int, *, peak_blocks: int, usable_blocks: int) -> None:
    """A request that needs more KV blocks at its peak (``peak_blocks`` for ``prompt + max_new_tokens - 1``
    positions) than the pool's ``usable_blocks`` could never finish: once it is the oldest it preempts every
    other request and then waits forever, and everyone behind it with it. Warmup guarantees room only for
    ``max_total_tokens``, which the router enforces; the shard checks it too."""
    if peak_blocks > usable_blocks:
        raise InvalidRequestError(
            f"request {request.id}: prompt {num_prompt} + max_new_tokens {request.stopping.max_new_tokens} "
            f"needs {peak_blocks} KV blocks at its peak, more than the {usable_blocks} of the pool: it could never "
            "finish"
        )


def validate_spans(
    request: RequestSpec, spans: Sequence[range], *, max_prefill_tokens: int, window: int | None = None
) -> None:
    """A bidirectional span (Gemma 3's image, PaliGemma's prompt) is prefilled in one chunk: one longer than the
    step's prefill budget could never run; ``window``: spans that see past the sliding window must fit it."""
    reason = longest_span_reason(spans, max_prefill_tokens, window)
    if reason is not None:
        raise InvalidRequestError(f"request {request.id}: {reason}")
