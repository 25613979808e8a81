"""Content-addressed retention of full KV blocks (prefix caching), verified by token ids.

A full block's K/V depends on every token before it, so a block is identified by a *hash chain*:
``chain_hash(i) = hash((chain_hash(i - 1), tokens of block i))`` with ``ROOT_HASH`` before block 0.
Entries are found by chain hash, then verified: the stored token ids must equal the block's tokens
and the stored parent must be the entry matched for the previous block. Parents are identified by a
serial number that is never reused, so a hash collision can never make two different prefixes share
a block (no false sharing); a collision only costs a cache miss.

Lifetime: a request registers its full committed blocks when it releases them; a registered block
whose refcount drops to 0 becomes *retained* in the pool (LRU, reclaimable). When the pool evicts a
retained block it calls :meth:`PrefixCache.forget_block`. Entries whose parent was evicted become
unreachable (*stale*); they stay until their own block is evicted, or are replaced when the same
content is registered again under a live parent.

A partly matching block is served by copy-on-write: after the last fully matching block, the child
entry sharing the longest run of leading tokens with the prompt is returned as a copy source.

``NullPrefixCache`` is the same interface with retention off (selected once, no flag checks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tgi_paged_backend.memory.block_keys import TierBlock, block_key, root_key
from tgi_paged_backend.memory.block_pool import BlockPool
from tgi_paged_backend.memory.types import SCRATCH_BLOCK

ROOT_HASH = 0
"""Chain hash "before" block 0."""
_ROOT_SERIAL = 0


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block given its parent's chain hash.

    Python's tuple-of-int hash is deterministic across processes (``PYTHONHASHSEED`` only affects
    ``str``/``bytes``) and 64-bit; collisions are tolerated because matches are verified.
    """
    return hash((parent_hash, token_ids))


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(slots=True)
class _Entry:
    block_id: int
    chain_hash: int
    serial: int
    parent_serial: int
    token_ids: tuple[int, ...]
    namespace: int = 0
    """The LoRA adapter index whose chain holds the entry (0: the base model)."""
    key: bytes = b""
    """Its chain digest (:mod:`.block_keys`) when KV tiers are on, else empty."""


class RegistryObserver(Protocol):
    """Told of every entry the cache adds and drops (the KV-events publisher,
    :mod:`tgi_paged_backend.telemetry.kv_events`): the calls mirror the registry exactly."""

    def block_stored(
        self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...], adapter: int
    ) -> None: ...

    def block_removed(self, block_hash: int) -> None: ...


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What :meth:`PrefixCache.match` found (nothing is pinned yet; the caller increfs).

    Attributes:
        block_ids: Physical blocks whose full contents match the prompt's leading blocks, in order.
        cow_src: A block whose first ``num_cow_tokens`` tokens match the prompt right after
            ``block_ids``; ``None`` when there is none.
        num_cow_tokens: Valid tokens to copy from ``cow_src`` (0 without a source).
        serials: The entries of ``block_ids`` (what other KV layer groups attach their blocks to).
        cow_serial: The entry of ``cow_src``.
    """

    block_ids: tuple[int, ...] = ()
    cow_src: int | None = None
    num_cow_tokens: int = 0
    serials: tuple[int, ...] = field(default=(), compare=False)
    cow_serial: int | None = field(default=None, compare=False)


_NO_HIT = PrefixHit()


@dataclass(frozen=True, slots=True)
class ChainCursor:
    """How far one request's blocks are registered: the chain's next block index and the identity
    of the entry before it. Lets a request whose leading blocks were given back (sliding-window
    holes) go on registering the blocks after them under the same verified chain."""

    num_blocks: int = 0
    parent_hash: int = ROOT_HASH
    parent_serial: int = _ROOT_SERIAL


CHAIN_START = ChainCursor()
"""Nothing registered yet: the chain starts at the root (the base model's)."""


def chain_root(namespace: int) -> ChainCursor:
    """Where the chains of ``namespace`` start: the root for 0 (the base model), one root per LoRA adapter
    index otherwise. The same tokens under two adapters are different K/V: their chains never meet, so
    no block is matched across adapters (roots have serials <= 0, never an entry's)."""
    if namespace == 0:
        return CHAIN_START
    # hash() of a positive int is the int, so the roots' hashes differ (hash(-1) == hash(-2) in CPython).
    return ChainCursor(0, hash((ROOT_HASH, namespace)), _ROOT_SERIAL - namespace)


class PrefixCache:
    """Registry of full blocks by content, layered over a :class:`BlockPool`.

    Args:
        pool: The pool whose blocks are registered; its ``on_evict`` must call :meth:`forget_block`.
        block_size: Tokens per block.
    """

    def __init__(
        self, pool: BlockPool, block_size: int, observer: RegistryObserver | None = None, salt: bytes | None = None
    ) -> None:
        self._pool = pool
        self.block_size = block_size
        self._observer = observer
        self._salt = salt
        """With KV tiers: every entry also gets its chain digest, salted with this (``None``: no digests)."""
        self._by_hash: dict[int, _Entry] = {}
        self._by_block: dict[int, _Entry] = {}
        self._by_serial: dict[int, _Entry] = {}
        self._children: dict[int, dict[int, _Entry]] = {}
        self._next_serial = _ROOT_SERIAL + 1
        self.on_forget: Callable[[int], None] | None = None
        """Told the serial of every entry dropped (other KV layer groups' blocks attached to it go)."""

    @property
    def num_entries(self) -> int:
        return len(self._by_block)

    def is_registered(self, block_id: int) -> bool:
        return block_id in self._by_block

    def is_live(self, cursor: ChainCursor) -> bool:
        """Whether a chain may still go on from ``cursor`` (its last entry was not dropped)."""
        return cursor.parent_serial <= _ROOT_SERIAL or cursor.parent_serial in self._by_serial

    def has_serial(self, serial: int) -> bool:
        """Whether the entry ``serial`` is held now."""
        return serial in self._by_serial

    # ------------------------------------------------------------------------ KV tiers' view
    def tier_block(self, block_id: int) -> TierBlock | None:
        """The identity of the registered ``block_id`` outside the pool (``None`` without digests)."""
        entry = self._by_block.get(block_id)
        if entry is None or self._salt is None:
            return None
        parent = self._by_serial.get(entry.parent_serial)
        parent_key = parent.key if parent is not None else root_key(self._salt, entry.namespace)
        parent_hash = parent.chain_hash if parent is not None else None
        return TierBlock(entry.key, parent_key, entry.token_ids, entry.namespace, entry.chain_hash, parent_hash)

    def serial_of(self, block_id: int) -> int:
        """The entry serial of the registered ``block_id``."""
        return self._by_block[block_id].serial

    def cursor_after(self, serials: Sequence[int], root: ChainCursor) -> tuple[ChainCursor, bytes, int | None]:
        """Where a chain that matched the entries ``serials`` from ``root`` goes on: its cursor, its chain
        digest there and the chain hash of its last entry (``None`` at the root). Needs digests."""
        assert self._salt is not None, "chain digests are off"
        if not serials:
            namespace = max(_ROOT_SERIAL - root.parent_serial, 0)
            return root, root_key(self._salt, namespace), None
        last = self._by_serial[serials[-1]]
        return ChainCursor(len(serials), last.chain_hash, last.serial), last.key, last.chain_hash

    # -------------------------------------------------------------------------------- matching
    def match(self, token_ids: Sequence[int], root: ChainCursor = CHAIN_START) -> PrefixHit:
        """Longest verified prefix of ``token_ids`` held in registered blocks under ``root`` (:func:`chain_root`).

        The hit always leaves at least the last token to compute: full blocks are matched only
        within ``token_ids[:-1]`` and the copy-on-write run stops before the last token.
        """
        bs = self.block_size
        limit = len(token_ids) - 1
        if limit <= 0:
            return _NO_HIT
        block_ids: list[int] = []
        serials: list[int] = []
        parent_hash, parent_serial = root.parent_hash, root.parent_serial
        for start in range(0, limit - bs + 1, bs):
            chunk = tuple(token_ids[start : start + bs])
            key = chain_hash(parent_hash, chunk)
            entry = self._by_hash.get(key)
            if entry is None or entry.parent_serial != parent_serial or entry.token_ids != chunk:
                break
            block_ids.append(entry.block_id)
            serials.append(entry.serial)
            parent_hash, parent_serial = key, entry.serial
        start = len(block_ids) * bs
        want = token_ids[start : min(limit, start + bs)]
        best: _Entry | None = None
        best_len = 0
        for child in self._children.get(parent_serial, {}).values():
            n = _common_prefix_len(child.token_ids, want)
            if n > best_len:
                best, best_len = child, n
        if not block_ids and best is None:
            return _NO_HIT
        if best is None:
            return PrefixHit(tuple(block_ids), serials=tuple(serials))
        return PrefixHit(tuple(block_ids), best.block_id, best_len, tuple(serials), best.serial)

    # ----------------------------------------------------------------------------- registering
    def register(
        self, token_ids: Sequence[int], block_ids: Sequence[int], num_tokens: int, root: ChainCursor = CHAIN_START
    ) -> int:
        """Register the full blocks among the first ``num_tokens`` tokens of a request.

        ``block_ids[i]`` holds tokens ``[i * block_size, (i + 1) * block_size)``. Blocks already
        registered (shared ones) are kept; a block whose content is already registered under another
        block is skipped (it will be freed, the chain continues through the existing entry). The walk
        stops at a scratch block or at a genuine hash collision.

        Returns:
            How many blocks were newly registered.
        """
        return self.extend(token_ids, block_ids, num_tokens, root)[1]

    def extend(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        num_tokens: int,
        cursor: ChainCursor,
        serials: list[int] | None = None,
    ) -> tuple[ChainCursor, int]:
        """:meth:`register` from ``cursor`` on (blocks before it are not looked at, and may be holes).
        ``serials``, when given, gets the entry of every block the chain walks appended.

        Returns:
            Where the chain now ends, and how many blocks were newly registered.
        """
        bs = self.block_size
        parent_hash, parent_serial = cursor.parent_hash, cursor.parent_serial
        if parent_serial > _ROOT_SERIAL and parent_serial not in self._by_serial:
            return cursor, 0  # the chain's last entry was evicted: nothing after it could be matched
        num_new = 0
        index, stop = cursor.num_blocks, min(num_tokens // bs, len(block_ids))
        while index < stop:
            block_id = block_ids[index]
            if block_id == SCRATCH_BLOCK:
                break
            chunk = tuple(token_ids[index * bs : (index + 1) * bs])
            key = chain_hash(parent_hash, chunk)
            entry = self._by_hash.get(key)
            if entry is not None and entry.parent_serial != parent_serial and self._is_stale(entry):
                self._drop_stale(entry)
                entry = None
            if entry is None:
                assert block_id not in self._by_block, f"block {block_id} registered under other content"
                entry = self._add(block_id, key, parent_serial, chunk)
                num_new += 1
            elif entry.parent_serial != parent_serial or entry.token_ids != chunk:
                break  # live collision: keep the existing entry, stop the chain here
            parent_hash, parent_serial = key, entry.serial
            if serials is not None:
                serials.append(entry.serial)
            index += 1
        return ChainCursor(index, parent_hash, parent_serial), num_new

    def forget_block(self, block_id: int) -> None:
        """Drop the entry of an evicted block (the pool's ``on_evict`` hook)."""
        entry = self._by_block.pop(block_id)
        del self._by_serial[entry.serial]
        if self._by_hash.get(entry.chain_hash) is entry:
            del self._by_hash[entry.chain_hash]
        siblings = self._children[entry.parent_serial]
        del siblings[entry.serial]
        if not siblings:
            del self._children[entry.parent_serial]
        if self._observer is not None:
            self._observer.block_removed(entry.chain_hash)
        if self.on_forget is not None:
            self.on_forget(entry.serial)

    def _add(self, block_id: int, key: int, parent_serial: int, chunk: tuple[int, ...]) -> _Entry:
        parent = self._by_serial.get(parent_serial) if parent_serial > _ROOT_SERIAL else None
        namespace = parent.namespace if parent is not None else max(_ROOT_SERIAL - parent_serial, 0)
        digest = b""
        if self._salt is not None:
            digest = block_key(parent.key if parent is not None else root_key(self._salt, namespace), chunk)
        entry = _Entry(block_id, key, self._next_serial, parent_serial, chunk, namespace, digest)
        if self._observer is not None:
            self._observer.block_stored(key, None if parent is None else parent.chain_hash, chunk, namespace)
        self._next_serial += 1
        self._by_hash[key] = entry
        self._by_block[block_id] = entry
        self._by_serial[entry.serial] = entry
        self._children.setdefault(parent_serial, {})[entry.serial] = entry
        return entry

    def _is_stale(self, entry: _Entry) -> bool:
        return entry.parent_serial > _ROOT_SERIAL and entry.parent_serial not in self._by_serial

    def _drop_stale(self, entry: _Entry) -> None:
        self.forget_block(entry.block_id)
        if self._pool.is_retained(entry.block_id):
            self._pool.discard_retained(entry.block_id)
        # A stale block still in use simply goes free when its last holder releases it.

    # ------------------------------------------------------------------------------ invariants
    def check_invariants(self, *, every_retained: bool = True) -> None:
        """Entries index each other consistently; registered blocks are used or retained, and (with
        ``every_retained``: the pool's only registry) every retained block is registered."""
        assert len(self._by_serial) == len(self._by_block)
        for block_id, entry in self._by_block.items():
            assert entry.block_id == block_id and block_id != SCRATCH_BLOCK
            assert self._by_serial[entry.serial] is entry
            assert self._children[entry.parent_serial][entry.serial] is entry
            assert len(entry.token_ids) == self.block_size
            assert self._pool.refcount(block_id) > 0 or self._pool.is_retained(block_id), (
                f"registered block {block_id} is free"
            )
        for entry in self._by_hash.values():
            assert self._by_block[entry.block_id] is entry
        assert sum(len(c) for c in self._children.values()) == len(self._by_block)
        if every_retained:
            for block_id in self._pool.retained_lru():
                assert block_id in self._by_block, f"retained block {block_id} is not registered"


class NullPrefixCache:
    """Prefix retention switched off: never matches, never registers (same interface)."""

    num_entries = 0

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self._pool = pool
        self.block_size = block_size

    def is_registered(self, block_id: int) -> bool:
        return False

    def match(self, token_ids: Sequence[int], root: ChainCursor = CHAIN_START) -> PrefixHit:
        return _NO_HIT

    def register(
        self, token_ids: Sequence[int], block_ids: Sequence[int], num_tokens: int, root: ChainCursor = CHAIN_START
    ) -> int:
        return 0

    def extend(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        num_tokens: int,
        cursor: ChainCursor,
        serials: list[int] | None = None,
    ) -> tuple[ChainCursor, int]:
        return cursor, 0

    def is_live(self, cursor: ChainCursor) -> bool:
        return True

    def forget_block(self, block_id: int) -> None:
        raise AssertionError("nothing is retained without prefix retention")

    def check_invariants(self, *, every_retained: bool = True) -> None:
        assert self._pool.num_retained_blocks == 0
