"""The host tier's books: which host-arena rows hold which retained block, in LRU order.

Ids only (the runner owns the arena tensors, :class:`~tgi_paged_backend.runner.kv_pool.KVPool`). An
entry is one block of the anchor KV group and the blocks other KV layer groups had attached to it at
the time: one arena row per group that had a block (``rows[g]`` is ``None`` where a sliding group had
already given its block back). The tier is *inclusive*: a block loaded back into the pool keeps its
entry, so when the pool evicts it again nothing is copied twice.

Lifecycle of an entry: :meth:`HostTier.reserve` takes rows for it (evicting least recently used
entries, each reported to ``on_evict``: the disk tier's spill) and leaves it *pending*; the engine calls
:meth:`HostTier.mark_landed` once the copies of the step have run, and only then does :meth:`lookup`
return it ("loadable only after its copy has landed"). Entries pinned by a load in progress are never
evicted. A full tier evicts instead of failing; when every row is pinned it refuses (the block is lost,
and counted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tgi_paged_backend.memory.block_keys import TierBlock


@dataclass(slots=True, eq=False)
class HostEntry:
    block: TierBlock
    rows: tuple[int | None, ...]
    """Arena row per KV layer group (``None``: that group had no block for these positions)."""
    landed: bool = False

    @property
    def used_rows(self) -> list[int]:
        return [r for r in self.rows if r is not None]


EvictHook = Callable[[HostEntry], None]


class HostTier:
    """LRU of host entries over ``num_rows`` arena rows.

    Args:
        num_rows: Rows of the host arena (0: the tier is off).
        on_evict: Told every entry evicted to make room (before its rows are reused).
    """

    def __init__(self, num_rows: int, on_evict: EvictHook | None = None) -> None:
        if num_rows < 0:
            raise ValueError(f"num_rows={num_rows} is invalid: allowed >= 0")
        self.num_rows = num_rows
        self.on_evict = on_evict
        self._free: list[int] = list(range(num_rows - 1, -1, -1))
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # least recently used first
        self._pending: list[HostEntry] = []
        self._pinned: dict[bytes, int] = {}
        self.num_evicted = 0
        self.num_refused = 0

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_used_rows(self) -> int:
        return self.num_rows - len(self._free)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def lookup(self, key: bytes) -> HostEntry | None:
        """The landed entry of ``key`` (now the most recently used), or ``None``."""
        entry = self._entries.get(key)
        if entry is None or not entry.landed:
            return None
        self._entries.move_to_end(key)
        return entry

    def peek(self, key: bytes) -> HostEntry | None:
        """The landed entry of ``key``, or ``None``; the LRU order is left alone (a query, not a use)."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.landed else None

    def reserve(self, block: TierBlock, group_mask: tuple[bool, ...]) -> HostEntry | None:
        """Rows for a new pending entry of ``block`` (one per ``True`` in ``group_mask``), evicting the least
        recently used unpinned entries; ``None`` when ``block`` is held already or the pinned entries leave
        no room."""
        if block.key in self._entries:
            return None
        need = sum(group_mask)
        if need > self.num_rows:
            self.num_refused += 1
            return None
        while len(self._free) < need:
            victim = next((e for k, e in self._entries.items() if k not in self._pinned), None)
            if victim is None:
                self.num_refused += 1
                return None
            self._evict(victim)
        rows = tuple(self._free.pop() if present else None for present in group_mask)
        entry = HostEntry(block, rows)
        self._entries[block.key] = entry
        self._pending.append(entry)
        return entry

    def mark_landed(self, entries: Iterable[HostEntry] | None = None) -> list[HostEntry]:
        """The copies filling ``entries`` (default: every pending entry) have run: those still pending
        become loadable. Returns them (an entry evicted meanwhile is not among them)."""
        if entries is None:
            landed, self._pending = self._pending, []
        else:
            done = {id(e) for e in entries}
            landed = [e for e in self._pending if id(e) in done]
            self._pending = [e for e in self._pending if id(e) not in done]
        for entry in landed:
            entry.landed = True
        return landed

    def land(self, entry: HostEntry) -> None:
        """One pending entry's rows are written (a disk fetch): it becomes loadable now."""
        if entry in self._pending:
            self._pending.remove(entry)
        entry.landed = True

    def pin(self, key: bytes) -> None:
        self._pinned[key] = self._pinned.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        count = self._pinned[key] - 1
        if count:
            self._pinned[key] = count
        else:
            del self._pinned[key]

    def drop(self, key: bytes) -> None:
        """Forget an entry without spilling it (its copy failed, or it was found invalid)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._free.extend(entry.used_rows)
            if entry in self._pending:
                self._pending.remove(entry)

    def clear(self) -> int:
        """Drop every entry (a new pool layout makes them meaningless); returns how many."""
        count = len(self._entries)
        for key in list(self._entries):
            self.drop(key)
        return count

    def _evict(self, entry: HostEntry) -> None:
        del self._entries[entry.block.key]
        if entry in self._pending:
            self._pending.remove(entry)
        self.num_evicted += 1
        if self.on_evict is not None:
            self.on_evict(entry)
        self._free.extend(entry.used_rows)

    def check_invariants(self) -> None:
        """Free rows and entries' rows partition the arena; pending entries are entries."""
        used = [r for e in self._entries.values() for r in e.used_rows]
        assert len(set(used)) == len(used), "a host row held by two entries"
        assert not set(used) & set(self._free), "a host row both free and held"
        assert len(used) + len(self._free) == self.num_rows, "a host row is lost"
        assert all(self._entries.get(e.block.key) is e and not e.landed for e in self._pending)
        assert all(k in self._entries for k in self._pinned), "a pinned entry is gone"
