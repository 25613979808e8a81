"""KV layer groups: which layers share a page map, so sliding-window layers can keep only their window.

Models that mix attention types (Gemma 2 and 3, gpt-oss, Cohere 2: full-attention layers beside
sliding-window ones) waste memory with one page map per request for all layers: the sliding layers hold
every block of the context although they read only their window. With layer groups (vLLM's hybrid KV
cache manager does the same), each group of layers of one attention type gets its own page map per
request over one shared pool, and a sliding group gives back the blocks behind its window.

For any block to serve any group, every group has the same number of layers ``layers_per_block`` (U): a
pool block holds the K/V of U layers (the runner's U *slot* tensors), and which layers those are depends on
the group that owns the block. The grouping rule:

- layers are split by attention type: full, and one type per distinct window;
- U is the smallest type's layer count, and each type's layers are cut, in layer order, into groups of U
  (the last one padded: a padded slot is memory no layer uses);
- full groups come first (group 0 anchors prefix retention in the design, ``docs/design-layer-groups.md``).

Shapes: Gemma-2 and gpt-oss alternate, so 2 groups of L/2; Cohere 2 (3 sliding : 1 full) 4 groups;
Gemma-3-27B (52 sliding, 10 full) U = 10, 7 groups, 8 padded slots; a model of one type: one group of
all its layers, which is the pool as it is today.

This module is the pure arithmetic (no torch): the grouping, and how many blocks one request holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tgi_paged_backend.memory.window_reclaim import max_request_blocks, num_blocks_outside_window


@dataclass(frozen=True, slots=True)
class LayerGroups:
    """The KV groups of a model's attention layers."""

    windows: tuple[int | None, ...]
    """Per group: its layers' sliding window in tokens, ``None`` for full attention. Full groups first."""
    layers: tuple[tuple[int, ...], ...]
    """Per group: its layer indices, in order; at most :attr:`layers_per_block` each (the last group of a
    type may have fewer: padding)."""
    layers_per_block: int
    """U: the layers whose K/V one pool block holds (the runner's slot tensors)."""

    def __post_init__(self) -> None:
        if len(self.windows) != len(self.layers) or not self.layers:
            raise ValueError("one window per group, and at least one group")
        flat = sorted(layer for group in self.layers for layer in group)
        if flat != list(range(len(flat))):
            raise ValueError(f"every layer in exactly one group: {self.layers}")
        if any(not 0 < len(g) <= self.layers_per_block for g in self.layers):
            raise ValueError(f"groups of 1..{self.layers_per_block} layers: {self.layers}")

    @classmethod
    def from_layer_windows(cls, layer_windows: Sequence[int | None]) -> LayerGroups:
        """Group layers by their window (``None``: full attention) by the rule of the module docstring."""
        if not layer_windows:
            raise ValueError("a model without attention layers has no KV groups")
        by_type: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            by_type.setdefault(int(window) if window else None, []).append(layer)
        per_block = min(len(layers) for layers in by_type.values())
        order = sorted(by_type, key=lambda w: (w is not None, w or 0))  # full first, then by window
        windows, groups = [], []
        for window in order:
            layers = by_type[window]
            for start in range(0, len(layers), per_block):
                windows.append(window)
                groups.append(tuple(layers[start : start + per_block]))
        return cls(tuple(windows), tuple(groups), per_block)

    @classmethod
    def uniform(cls, num_layers: int, window: int | None = None) -> LayerGroups:
        """One group of every layer (today's single page map)."""
        return cls((window,), (tuple(range(num_layers)),), num_layers)

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        return sum(len(g) for g in self.layers)

    @property
    def num_padding(self) -> int:
        """Slots of group blocks no layer uses (memory the grouping spends on equal-sized blocks)."""
        return self.num_groups * self.layers_per_block - self.num_layers

    @property
    def is_hybrid(self) -> bool:
        """Full and windowed layers side by side (more than one group of different windows)."""
        return len(set(self.windows)) > 1

    def layer_group(self, layer: int) -> int:
        """The group of ``layer``."""
        return next(g for g, layers in enumerate(self.layers) if layer in layers)

    def layer_slot(self, layer: int) -> int:
        """The position of ``layer`` in its group: which of a block's U slots holds its K/V."""
        return self.layers[self.layer_group(layer)].index(layer)

    def request_blocks(self, num_tokens: int, block_size: int, max_chunk_tokens: int) -> int:
        """Pool blocks one request of ``num_tokens`` positions holds at most, computed in chunks of at most
        ``max_chunk_tokens``: every block in a full group, about a window's worth in a sliding one."""
        return sum(max_request_blocks(num_tokens, block_size, w, max_chunk_tokens) for w in self.windows)

    def final_blocks(self, num_tokens: int, block_size: int) -> tuple[int, ...]:
        """Per group: the blocks one request holds once its last step, a one-token decode, wrote position
        ``num_tokens - 1`` (a sliding group has given back every block wholly behind that query's window)."""
        full = -(-num_tokens // block_size)
        last = max(num_tokens - 1, 0)
        return tuple(full - (0 if w is None else num_blocks_outside_window(last, w, block_size)) for w in self.windows)

    def saving(self, num_tokens: int, block_size: int, max_chunk_tokens: int) -> float:
        """Share of one request's KV bytes at ``num_tokens`` that the groups free against one page map for
        all layers (padding counted): ``1 - request_blocks * U / (ceil(num_tokens / block_size) * layers)``."""
        full = -(-num_tokens // block_size)
        if full <= 0:
            return 0.0
        kept = self.request_blocks(num_tokens, block_size, max_chunk_tokens) * self.layers_per_block
        return 1.0 - kept / (full * self.num_layers)
