"""The stock router's prefix-caching allocator (``RadixAllocator``), replayed.

A radix trie over the router's own token ids, keyed on whole blocks: every node holds a key of
``k * block_size`` token ids and the ``k`` blocks that hold their KV; a child is found by its first
block of ids. Behaviour kept from the stock allocator:

* ``find`` returns the longest **block-aligned** shared prefix (a node only partly matched still
  contributes its matched blocks) and refreshes access times along the path;
* the matched node is ref-counted while the request lives (also across a failed allocation, which
  undoes it); nodes with children are always referenced;
* when the free list is short, least-recently-used unreferenced **leaves** are evicted, and the last
  one may be trimmed from its end (only the blocks still needed are taken);
* on free, the prompt's full blocks are inserted (the blocks of a prefix that another request
  inserted meanwhile go back to the free list), and everything past the last full prompt block is
  freed. Requests without prompt ids (prefill logprobs) bypass the trie entirely;
* insertion happens whether or not the allocation was ever prefilled (the stock caveat).

Node ids are a counter (stock uses slot-map keys), which only matters to break LRU ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .allocator import BlockAllocation, ceil_div, slots_for_blocks


@dataclass(eq=False)
class _Node:
    node_id: int
    key: list[int]
    blocks: list[int]
    parent: _Node | None
    last_accessed: int
    ref_count: int = 0
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)


class RadixTrie:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.time = 0
        self._next_id = 0
        self.root = self._make_node([], [], None)
        self.leaves: set[tuple[int, int]] = set()
        self._nodes: dict[int, _Node] = {self.root.node_id: self.root}

    def _make_node(self, key: list[int], blocks: list[int], parent: _Node | None) -> _Node:
        node = _Node(self._next_id, key, blocks, parent, self.time)
        self._next_id += 1
        return node

    def _edge(self, key: Sequence[int]) -> tuple[int, ...]:
        return tuple(key[: self.block_size])

    def _shared_prefix(self, left: Sequence[int], right: Sequence[int]) -> int:
        full = 0
        for a, b in zip(left, right):
            if a != b:
                break
            full += 1
        return (full // self.block_size) * self.block_size

    def _touch(self, node: _Node) -> None:
        entry = (node.last_accessed, node.node_id)
        if entry in self.leaves:
            self.leaves.remove(entry)
            self.leaves.add((self.time, node.node_id))
        node.last_accessed = self.time

    def find(self, key: Sequence[int]) -> tuple[_Node, list[int]]:
        """Node holding the longest cached prefix of ``key``, and that prefix's blocks."""
        self.time += 1
        node, blocks = self.root, []
        while len(key) >= self.block_size:
            child = node.children.get(self._edge(key))
            if child is None:
                break
            self._touch(child)
            shared = self._shared_prefix(child.key, key)
            blocks.extend(child.blocks[: shared // self.block_size])
            key = key[shared:]
            if key and shared == len(child.key):
                node = child
                continue
            return child, blocks
        return node, blocks

    def incref(self, node: _Node) -> None:
        if node is self.root:
            return
        if node.ref_count == 0:
            self.leaves.discard((node.last_accessed, node.node_id))
        node.ref_count += 1

    def decref(self, node: _Node) -> None:
        if node is self.root:
            return
        if node.ref_count == 0:
            raise AssertionError("radix trie refcount underflow")
        node.ref_count -= 1
        if node.ref_count == 0:
            assert not node.children, "nodes with children must be referenced"
            self.leaves.add((node.last_accessed, node.node_id))

    def evict(self, n_blocks: int) -> list[int]:
        """Evict up to ``n_blocks`` blocks from LRU unreferenced leaves (the last may be trimmed)."""
        evicted: list[int] = []
        while self.leaves:
            entry = min(self.leaves)
            self.leaves.remove(entry)
            node = self._nodes[entry[1]]
            assert node.ref_count == 0, "leaf must be unreferenced"
            needed = max(0, n_blocks - len(evicted))
            if needed >= len(node.blocks):
                self._remove(node)
                evicted.extend(node.blocks)
                if len(evicted) >= n_blocks:
                    break
            else:
                keep = len(node.blocks) - needed
                node.key = node.key[: keep * self.block_size]
                evicted.extend(node.blocks[keep:])
                node.blocks = node.blocks[:keep]
                self.leaves.add(entry)
                break
        return evicted

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Insert a block-aligned prompt; returns how many leading tokens were already cached."""
        self.time += 1
        return self._insert(self.root, list(tokens), list(blocks))

    def _insert(self, node: _Node, tokens: list[int], blocks: list[int]) -> int:
        assert len(tokens) == len(blocks) * self.block_size
        child = node.children.get(self._edge(tokens))
        if child is None:
            self._add(node, tokens, blocks)
            return 0
        self._touch(child)
        shared = self._shared_prefix(child.key, tokens)
        if shared == len(tokens) or shared == 0:
            return shared
        if shared != len(child.key):
            child = self._split(child, shared)
        rest = self._insert(child, tokens[shared:], blocks[shared // self.block_size :])
        return shared + rest

    def _split(self, node: _Node, prefix_len: int) -> _Node:
        """Give ``node``'s first ``prefix_len`` ids to a new parent; ``node`` keeps its identity."""
        prefix_key, node.key = node.key[:prefix_len], node.key[prefix_len:]
        n = prefix_len // self.block_size
        prefix_blocks, node.blocks = node.blocks[:n], node.blocks[n:]
        grandparent = node.parent
        assert grandparent is not None
        parent = self._add(grandparent, prefix_key, prefix_blocks)
        self._attach(parent, node)
        node.parent = parent
        return parent

    def _add(self, parent: _Node, key: list[int], blocks: list[int]) -> _Node:
        child = self._make_node(key, blocks, parent)
        self._nodes[child.node_id] = child
        self._attach(parent, child)
        self.leaves.add((self.time, child.node_id))
        return child

    def _attach(self, parent: _Node, child: _Node) -> None:
        edge = self._edge(child.key)
        replaced = edge in parent.children
        parent.children[edge] = child
        if not replaced:
            self.incref(parent)

    def _remove(self, node: _Node) -> None:
        assert not node.children, "cannot remove a node with children"
        parent = node.parent
        assert parent is not None, "cannot remove the root"
        del self._nodes[node.node_id]
        parent.children.pop(self._edge(node.key), None)
        self.decref(parent)

    def cached_blocks(self) -> int:
        return sum(len(n.blocks) for n in self._nodes.values())


@dataclass
class _RadixAllocation:
    prefix_node: _Node
    cached_prefix_len: int
    prefill_tokens: list[int] | None


class RadixAllocator:
    def __init__(self, block_size: int, num_blocks: int, window_size: int | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.window_size = window_size  # ignored, as in the stock radix allocator
        self.trie = RadixTrie(block_size)
        self.free_blocks: list[int] = list(range(1, num_blocks))
        self._allocation_id = 0
        self._allocations: dict[int, _RadixAllocation] = {}

    def free_block_count(self) -> int:
        return len(self.free_blocks)

    def _alloc_or_reclaim(self, needed: int) -> list[int] | None:
        if len(self.free_blocks) < needed:
            self.free_blocks.extend(self.trie.evict(needed - len(self.free_blocks)))
        if len(self.free_blocks) < needed:
            return None
        split = len(self.free_blocks) - needed
        taken = self.free_blocks[split:]
        del self.free_blocks[split:]
        return taken

    def allocate(self, tokens: int, prefill_tokens: Sequence[int] | None) -> BlockAllocation | None:
        prompt = list(prefill_tokens) if prefill_tokens is not None else None
        if prompt is not None:
            node, blocks = self.trie.find(prompt)
        else:
            node, blocks = self.trie.root, []
        # Referenced even if the allocation fails below, then released again.
        self.trie.incref(node)
        prefix_len = len(blocks) * self.block_size
        suffix = self._alloc_or_reclaim(ceil_div(tokens - prefix_len, self.block_size))
        if suffix is None:
            self.trie.decref(node)
            return None
        blocks.extend(suffix)
        self._allocation_id += 1
        self._allocations[self._allocation_id] = _RadixAllocation(node, prefix_len, prompt)
        return BlockAllocation(
            blocks=blocks,
            slots=slots_for_blocks(blocks, self.block_size, tokens),
            prefix_len=prefix_len,
            allocation_id=self._allocation_id,
            allocator=self,
        )

    def free(self, blocks: list[int], allocation_id: int) -> None:
        allocation = self._allocations.pop(allocation_id)
        self.trie.decref(allocation.prefix_node)
        prompt = allocation.prefill_tokens
        if prompt is None:
            self.free_blocks.extend(blocks)
            return
        bs = self.block_size
        cached = allocation.cached_prefix_len
        if len(prompt) > cached:
            aligned = (len(prompt) // bs) * bs
            if aligned > 0:
                already = self.trie.insert(prompt[:aligned], blocks[: aligned // bs])
                if already > cached:
                    # Another request inserted part of this prompt meanwhile: ours are duplicates.
                    self.free_blocks.extend(blocks[cached // bs : already // bs])
        self.free_blocks.extend(blocks[len(prompt) // bs :])
