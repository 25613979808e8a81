"""Sliding-window block reclaim: the position arithmetic (pure functions) and the release itself.

When *every* attention layer of a model sees only the last ``window`` positions (itself included;
Mistral-v0.1-style ``sliding_window``), a query at position ``p`` reads keys ``[p - window + 1, p]``
and nothing before. A step that writes positions ``[start, end)`` therefore never reads a block whose
last position is below ``start - window + 1``, and neither does any later step (positions only grow;
a recompute preemption re-prefills from position 0 and maps blocks afresh). The manager gives such
blocks back to the pool at the start of the step: their page-map entries become *holes* that map to
the scratch block, which the window mask never lets the kernels use. Holes are always a prefix of
the page map.

Models that mix windowed and full-attention layers (Gemma 2/3, gpt-oss, Cohere 2) get no window
here (``None``): their full layers read every position, and one page map serves all layers of a
request, so no block is outside every layer's window. A page map per layer group (vLLM's hybrid
allocator) would save :func:`hybrid_pool_saving` of their KV (less the padding of
:mod:`.layer_groups`, which computes the groups): the engine pages such models by layer group
(``KVCacheManager(groups=...)``, :mod:`.kv_group`), each sliding group reclaiming here behind its
own window (``docs/design-layer-groups.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.block_table import BlockTableArray
from tgi_paged_backend.memory.page_map import PageMap
from tgi_paged_backend.memory.types import SCRATCH_BLOCK


def first_visible_position(first_query_position: int, window: int) -> int:
    """Lowest key position a query at ``first_query_position`` (or any later one) reads."""
    return max(first_query_position - window + 1, 0)


def num_blocks_outside_window(first_query_position: int, window: int, block_size: int) -> int:
    """Leading blocks wholly below the window of a query at ``first_query_position``.

    Block ``i`` holds positions ``[i * block_size, (i + 1) * block_size)``; it is outside when its
    last position is below :func:`first_visible_position`.
    """
    return first_visible_position(first_query_position, window) // block_size


def max_resident_blocks(window: int, block_size: int, num_new_tokens: int = 1) -> int:
    """Most blocks one request holds during a step writing ``num_new_tokens`` positions.

    The step reads positions ``[start - window + 1, start + num_new_tokens)`` (``window +
    num_new_tokens - 1`` positions), which straddle at most one more block than they fill.
    """
    return -(-(window + num_new_tokens - 1) // block_size) + 1


def release_blocks_outside_window(
    req: PageMap, num_outside: int, *, pool: BlockPool, table: BlockTableArray, is_registered: Callable[[int], bool]
) -> int:
    """Turn the page map's first ``num_outside`` entries into holes; returns the blocks given back.

    Released last-first, like every release. A block the prefix cache knows (the manager registers
    the full committed ones just before) is retained, any other goes free.
    """
    if num_outside <= req.num_holes:
        return 0
    num_released = 0
    for index in range(num_outside - 1, req.num_holes - 1, -1):
        block_id = req.blocks[index]
        if block_id != SCRATCH_BLOCK:
            pool.decref(block_id, retain=is_registered(block_id))
            req.blocks[index] = SCRATCH_BLOCK
            num_released += 1
    table.unmap(req.row, req.num_holes, num_outside)
    req.num_holes = num_outside
    return num_released


def max_request_blocks(num_tokens: int, block_size: int, window: int | None, max_chunk_tokens: int) -> int:
    """Most pool blocks one request of ``num_tokens`` positions holds at once, computed in chunks of
    at most ``max_chunk_tokens`` (all of them without a window)."""
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    return min(full, max_resident_blocks(window, block_size, max(max_chunk_tokens, 1)))


def reclaim_window(window: int | None, layer_windows: Sequence[int | None] | None) -> int | None:
    """The window the manager may reclaim behind: ``window`` if every layer uses it, else ``None``.

    Args:
        window: The model's sliding window (``None``: no layer is windowed).
        layer_windows: Each attention layer's window (``None`` for a full-attention layer), or
            ``None`` when every layer uses ``window``.
    """
    if not window:
        return None
    if layer_windows is None:
        return int(window)
    if not layer_windows or any(w != window for w in layer_windows):
        return None
    return int(window)


def hybrid_pool_saving(layer_windows: Sequence[int | None], seq_len: int, block_size: int) -> float:
    """Share of one request's KV that per-layer-group pools would free at ``seq_len`` tokens.

    With one pool per group (vLLM's hybrid allocator), a windowed layer keeps only about
    :func:`max_resident_blocks` blocks while a full layer keeps all ``ceil(seq_len / block_size)``.
    Returns ``1 - (kept blocks over all layers) / (all blocks over all layers)``; 0 for no layers.
    """
    if not layer_windows or seq_len <= 0:
        return 0.0
    full = -(-seq_len // block_size)
    kept = sum(full if w is None else min(full, max_resident_blocks(w, block_size)) for w in layer_windows)
    return 1.0 - kept / (full * len(layer_windows))
