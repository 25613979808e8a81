"""KV tiers below the pool: retained prefix blocks the pool evicts live on in host RAM (and on disk).

:class:`PrefixTiers` is the part of :class:`~.kv_cache_manager.KVCacheManager` that deals with the
host tier (:class:`~.host_tier.HostTier`, ids only). It issues *moves* that the runner executes in issue
order, before the step's forward and interleaved with the step's other copies exactly as issued (the
ordering rule of :mod:`.types`):

- ``("offload", pool blocks, host rows)``: the pool is about to evict a retained anchor block (LRU
  reclaim, eviction for an allocation, ``ClearCache``): its K/V, and that of the blocks other KV layer
  groups attached to it, is copied to host rows first. A block whose key the tier holds already (it was
  loaded from there) is not copied again.
- ``("load", host rows, pool blocks)``: a prompt's chain goes on in the host tier where the pool's hit
  ends: the entries are copied into fresh pool blocks, registered in the pool's registries as retained
  blocks, and the pool's ordinary match then shares them (:meth:`PrefixTiers.promote`).

Entries go to ``spill`` (the disk tier, when one is configured) once their copy has landed
(write-through), and again when the host tier evicts them (the disk store ignores what it holds). Keys
are chain digests (:mod:`.block_keys`), so a host or disk entry is found by content, never by a serial of
the pool that wrote it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tgi_paged_backend.memory.attached_blocks import AttachedBlocks
from tgi_paged_backend.memory.block_keys import TierBlock, block_key
from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.host_tier import HostEntry, HostTier
from tgi_paged_backend.memory.prefix_cache import ChainCursor, PrefixCache, chain_hash
from tgi_paged_backend.memory.types import SCRATCH_BLOCK

TierMove = tuple[str, list[int], list[int]]
"""``(kind, src ids, dst ids)``: ``offload`` pool -> host rows, ``load`` host rows -> pool."""


class TierObserver:
    """Told of every block a tier stores or drops (KV events with their medium); no-op by default."""

    def tier_stored(self, medium: str, block: TierBlock) -> None:
        return None

    def tier_removed(self, medium: str, block: TierBlock) -> None:
        return None


@dataclass(slots=True)
class TierCounters:
    """Cumulative host-tier traffic, in blocks of the anchor group (one block = ``block_size`` tokens)."""

    offloaded_blocks: int = 0
    """Anchor blocks copied pool -> host."""
    offloaded_rows: int = 0
    """Arena rows written (every group's block of those positions)."""
    skipped_offloads: int = 0
    """Evicted blocks the tier held already (not copied twice)."""
    lost_blocks: int = 0
    """Evicted blocks the tier had no room for (every row pinned)."""
    loaded_blocks: int = 0
    """Anchor blocks copied host -> pool for a prefix hit."""
    loaded_rows: int = 0
    swap_kept_rows: int = 0
    """Blocks a swap-out left in the host tier instead of copying them to swap space (every group's)."""


class PrefixTiers:
    """Offloads evicted anchor blocks to the host tier and promotes host hits back into the pool."""

    def __init__(
        self,
        *,
        pool: BlockPool,
        anchor: PrefixCache,
        attached: Sequence[AttachedBlocks],
        host: HostTier,
        block_size: int,
        spill: Callable[[HostEntry], None] | None = None,
        observer: TierObserver | None = None,
    ) -> None:
        self._pool = pool
        self._anchor = anchor
        self._attached = list(attached)
        self.host = host
        self.block_size = block_size
        self._spill = spill
        self.observer = observer or TierObserver()
        self.moves: list[TierMove] = []
        self._filling: list[HostEntry] = []
        """Entries whose offload is in :attr:`moves` (not taken yet)."""
        self._taken: list[HostEntry] = []
        """Entries whose offload was taken: they land at the next :meth:`moves_landed`."""
        self.counters = TierCounters()
        host.on_evict = self._host_evicted

    def take_moves(self) -> list[TierMove]:
        """The moves issued since the last call, in issue order (the caller executes them in that order)."""
        moves, self.moves = self.moves, []
        self._taken.extend(self._filling)
        self._filling = []
        return moves

    def moves_landed(self) -> None:
        """Every move taken so far has run: the entries they filled become loadable, and go to ``spill``
        (write-through: the disk tier holds what the host tier holds, so a restart finds whole chains, not
        only the tails the host tier happened to evict). An offload issued but not taken yet has not run:
        its entry stays pending (its rows hold nothing yet)."""
        taken, self._taken = self._taken, []
        for entry in self.host.mark_landed(taken):
            if self._spill is not None:
                self._spill(entry)

    def evict_retained(self, limit: int) -> int:
        """Evict up to ``limit`` retained pool blocks, oldest first (their offloads join :attr:`moves`);
        returns how many. At shutdown the engine pushes the pool's retained blocks down to disk this way."""
        return self._pool.evict_all_retained(limit)

    # -------------------------------------------------------------------------- pool -> host
    def pool_evicting(self, block_id: int) -> None:
        """The pool evicts the retained ``block_id`` (still registered): keep its K/V in the host tier."""
        if not self._anchor.is_registered(block_id):
            return  # another group's block: it goes with its anchor entry
        block = self._anchor.tier_block(block_id)
        assert block is not None, "KV tiers need chain digests"
        if block.key in self.host:
            self.counters.skipped_offloads += 1
            return
        serial = self._anchor.serial_of(block_id)
        others = [group.block_for(serial) for group in self._attached]
        entry = self.host.reserve(block, (True, *(b is not None for b in others)))
        if entry is None:
            self.counters.lost_blocks += 1
            return
        src = [block_id, *(b for b in others if b is not None)]
        self.moves.append(("offload", src, entry.used_rows))
        self._filling.append(entry)
        self.counters.offloaded_blocks += 1
        self.counters.offloaded_rows += len(src)
        self.observer.tier_stored("CPU", block)

    def _host_evicted(self, entry: HostEntry) -> None:
        self.observer.tier_removed("CPU", entry.block)
        if self._spill is not None and entry.landed:
            self._spill(entry)

    # -------------------------------------------------------------------------- host -> pool
    def host_chain(self, token_ids: Sequence[int], root: ChainCursor, limit: int | None) -> tuple[int, list[HostEntry]]:
        """Where the pool's hit for ``token_ids`` ends (in blocks) and the landed host entries that go on
        from there, in order (full blocks of ``token_ids[:-1]``, at most ``limit`` blocks in all)."""
        hit = self._anchor.match(token_ids, root)
        num_pool = len(hit.block_ids) if limit is None else min(len(hit.block_ids), limit)
        _, key, _ = self._anchor.cursor_after(hit.serials[:num_pool], root)
        found: list[HostEntry] = []
        bs, index = self.block_size, num_pool
        while (index + 1) * bs <= len(token_ids) - 1 and (limit is None or index < limit):
            chunk = tuple(int(t) for t in token_ids[index * bs : (index + 1) * bs])
            next_key = block_key(key, chunk)
            entry = self.host.lookup(next_key)
            if entry is None or entry.block.token_ids != chunk or entry.block.parent != key:
                break
            found.append(entry)
            key, index = next_key, index + 1
        return num_pool, found

    def promote(self, token_ids: Sequence[int], root: ChainCursor, limit: int | None) -> int:
        """Load the host entries that extend the pool's hit for ``token_ids`` into fresh pool blocks and
        register them there as retained (the caller's pool match then shares them). Returns the anchor
        blocks loaded (as many as the pool can take without evicting the hit itself)."""
        num_pool, found = self.host_chain(token_ids, root, limit)
        if not found:
            return 0
        hit = self._anchor.match(token_ids, root)
        pinned = self._pin_hit(hit.block_ids[:num_pool], hit.serials[:num_pool])
        for entry in found:
            self.host.pin(entry.block.key)
        try:
            while found and sum(len(e.used_rows) for e in found) > self._pool.num_available_blocks:
                self.host.unpin(found.pop().block.key)
            if found:
                self._load(token_ids, root, hit.serials[:num_pool], found)
        finally:
            for entry in found:
                self.host.unpin(entry.block.key)
            for block_id in reversed(pinned):
                self._pool.decref(block_id, retain=True)
        return len(found)

    def _pin_hit(self, block_ids: Sequence[int], serials: Sequence[int]) -> list[int]:
        """Hold the pool hit's blocks (every group's) while the load allocates: it must not evict them."""
        pinned = list(block_ids)
        for group in self._attached:
            pinned.extend(b for s in serials if (b := group.block_for(s)) is not None)
        for block_id in pinned:
            self._pool.incref(block_id)
        return pinned

    def _load(
        self, token_ids: Sequence[int], root: ChainCursor, hit_serials: Sequence[int], found: list[HostEntry]
    ) -> None:
        new = self._pool.allocate(sum(len(e.used_rows) for e in found))
        assert new is not None, "the pool had the blocks a moment ago"
        per_group: list[list[int]] = [[] for _ in range(1 + len(self._attached))]
        cursor = iter(new)
        src: list[int] = []
        dst: list[int] = []
        for entry in found:
            for g, row in enumerate(entry.rows):
                block_id = next(cursor) if row is not None else SCRATCH_BLOCK
                per_group[g].append(block_id)
                if row is not None:
                    src.append(row)
                    dst.append(block_id)
        self.moves.append(("load", src, dst))
        start, _, _ = self._anchor.cursor_after(hit_serials, root)
        num_tokens = (start.num_blocks + len(found)) * self.block_size
        serials: list[int] = []
        anchor_blocks = [SCRATCH_BLOCK] * start.num_blocks + per_group[0]
        self._anchor.extend(token_ids, anchor_blocks, num_tokens, start, serials)
        for group, blocks in zip(self._attached, per_group[1:]):
            group.attach(blocks, serials, 0)
        registries: list[PrefixCache | AttachedBlocks] = [self._anchor, *self._attached]
        for registry, blocks in zip(registries, per_group):
            for block_id in reversed(blocks):
                if block_id != SCRATCH_BLOCK:
                    self._pool.decref(block_id, retain=registry.is_registered(block_id))
        self.counters.loaded_blocks += len(found)
        self.counters.loaded_rows += len(src)

    # ------------------------------------------------------------------------------ swap
    def held_rows(self, group_blocks: Sequence[Sequence[int]]) -> tuple[list[dict[int, int]], list[bytes]]:
        """The blocks of one request (``group_blocks[g]``: its map in group ``g``, token order) whose KV a
        landed host entry holds: per group ``{index in the map: host row}``, and those entries' keys. Only
        the anchor's registered blocks have keys; another group's block counts where the entry has its row."""
        held: list[dict[int, int]] = [{} for _ in group_blocks]
        keys: list[bytes] = []
        for index, block_id in enumerate(group_blocks[0]):
            block = self._anchor.tier_block(block_id) if self._anchor.is_registered(block_id) else None
            entry = None if block is None else self.host.peek(block.key)
            if entry is None:
                continue
            keys.append(entry.block.key)
            for g, (blocks, row) in enumerate(zip(group_blocks, entry.rows)):
                if row is not None and index < len(blocks) and blocks[index] != SCRATCH_BLOCK:
                    held[g][index] = row
        return held, keys

    def keep_for_swap(self, keys: Sequence[bytes], num_rows: int) -> None:
        """A swap-out left ``num_rows`` blocks in the entries of ``keys``: pin them until :meth:`load_swapped`
        or :meth:`release_swapped` (a pinned entry is never evicted)."""
        for key in keys:
            self.host.pin(key)
        self.counters.swap_kept_rows += num_rows

    def load_swapped(self, rows: list[int], blocks: list[int], keys: Sequence[bytes]) -> None:
        """Swap-in: the kept rows go back into pool ``blocks`` (a ``load`` move), and the pins end (the move
        is issued, so a later reuse of the rows runs after it)."""
        if rows:
            self.moves.append(("load", rows, blocks))
        self.release_swapped(keys)

    def release_swapped(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.host.unpin(key)

    # ------------------------------------------------------------------------------ disk
    def missing_blocks(self, token_ids: Sequence[int], root: ChainCursor, limit: int | None) -> list[TierBlock]:
        """The full blocks of ``token_ids[:-1]`` past what the pool and the host tier hold, in chain order
        (the disk tier is asked for these, and stops at the first it lacks)."""
        num_pool, found = self.host_chain(token_ids, root, limit)
        index = num_pool + len(found)
        hit = self._anchor.match(token_ids, root)
        _, key, parent_hash = self._anchor.cursor_after(hit.serials[:num_pool], root)
        for entry in found:
            key, parent_hash = entry.block.key, entry.block.chain_hash
        chash = root.parent_hash if parent_hash is None else parent_hash
        namespace = max(-root.parent_serial, 0)
        missing: list[TierBlock] = []
        bs = self.block_size
        while (index + 1) * bs <= len(token_ids) - 1 and (limit is None or index < limit):
            chunk = tuple(int(t) for t in token_ids[index * bs : (index + 1) * bs])
            next_key, next_hash = block_key(key, chunk), chain_hash(chash, chunk)
            missing.append(TierBlock(next_key, key, chunk, namespace, next_hash, parent_hash))
            key, chash, parent_hash, index = next_key, next_hash, next_hash, index + 1
        return missing


@dataclass(frozen=True, slots=True)
class TierSetup:
    """What the manager needs to keep a host tier (``host_rows == 0``: no tier)."""

    host_rows: int
    salt: bytes
    """The fingerprint digest the chain digests start from (:func:`.block_keys.root_key`)."""
    spill: Callable[[HostEntry], None] | None = None
    observer: TierObserver | None = None


def build_tiers(
    setup: TierSetup | None, pool: BlockPool, registries: Sequence[object], block_size: int
) -> PrefixTiers | None:
    """The host tier over ``pool`` whose groups keep ``registries`` (the anchor's first); ``None`` when
    ``setup`` asks for none or retention is off (nothing is retained, so nothing is evicted)."""
    anchor = registries[0]
    if setup is None or setup.host_rows <= 0 or not isinstance(anchor, PrefixCache):
        return None
    attached = [r for r in registries[1:] if isinstance(r, AttachedBlocks)]
    host = HostTier(setup.host_rows)
    return PrefixTiers(
        pool=pool, anchor=anchor, attached=attached, host=host, block_size=block_size,
        spill=setup.spill, observer=setup.observer,
    )  # fmt: skip
