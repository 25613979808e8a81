"""The KV tiers' bytes: host-tier copies, spills to disk, fetches from disk.

:class:`TierIO` executes what the memory manager decided (:mod:`tgi_paged_backend.memory.prefix_tiers`):

- ``run(kind, src, dst)``: one ``offload`` (pool -> host rows) or ``load`` (host rows -> pool) move, in the
  step's copy order (``ModelStep`` calls it).
- ``spill(entry)``: the host tier evicts a landed entry: its rows are read (a memcpy, now, before the rows
  are reused) and handed to the disk store, whose writer thread puts them in a file. No disk I/O on the
  engine thread.
- ``fetch(kv, token_ids, namespace)``: at admission, the prompt's full blocks past what the pool and the
  host tier hold are read from the disk tier (in chain order, stopping at the first it lacks or finds
  invalid) into host rows; the match that follows loads them like any host entry. This read is the one disk
  access on the engine thread: it replaces a prefill of the same tokens, which costs far more
  (``examples/bench_kv_tiers.py`` measures both).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tgi_paged_backend.memory.block_keys import TierBlock
from tgi_paged_backend.memory.host_tier import HostEntry
from tgi_paged_backend.memory.prefix_cache import chain_root
from tgi_paged_backend.offload.disk_store import BlockRecord, DiskStore
from tgi_paged_backend.offload.tier_copies import tier_copies_for

if TYPE_CHECKING:
    from tgi_paged_backend.memory.kv_cache_manager import KVCacheManager
    from tgi_paged_backend.runner.kv_pool import KVPool


PERSIST_BUDGET_S = 10.0
"""Longest a clean shutdown spends pushing retained pool blocks to the disk tier."""


@dataclass(slots=True)
class TierTraffic:
    """Cumulative bytes and seconds each way (one set per process)."""

    offload_bytes: int = 0
    offload_s: float = 0.0
    load_bytes: int = 0
    load_s: float = 0.0
    spill_bytes: int = 0
    spilled_blocks: int = 0
    fetch_bytes: int = 0
    fetch_s: float = 0.0
    fetched_blocks: int = 0
    """Blocks read from disk into the host tier."""
    invalid_fetches: int = 0
    """Disk records that did not belong where the chain asked (wrong tokens, parent or layer groups)."""


class TierIO:
    """Moves the tiers' bytes for one pool (one TP rank)."""

    def __init__(self, pool: KVPool, disk: DiskStore | None = None) -> None:
        self.pool = pool
        self.disk = disk
        self.traffic = TierTraffic()
        self.copies = tier_copies_for(pool)
        """Where the moves run (:mod:`.tier_copies`: inline on CPU, a copy stream on CUDA)."""

    def row_bytes(self) -> int:
        return self.pool.block_bytes

    def run(self, kind: str, src: Sequence[int], dst: Sequence[int]) -> None:
        """One host-tier move of the step's copy list (``offload`` or ``load``). On CUDA the seconds are the
        issue time (the copies run on the copy stream)."""
        t0 = time.perf_counter()
        if kind == "offload":
            self.copies.offload(src, dst)
            self.traffic.offload_bytes += len(src) * self.row_bytes()
            self.traffic.offload_s += time.perf_counter() - t0
        elif kind == "load":
            self.copies.load(src, dst)
            self.traffic.load_bytes += len(src) * self.row_bytes()
            self.traffic.load_s += time.perf_counter() - t0
        else:
            raise ValueError(f"not a host-tier move: {kind!r}")

    def settle(self) -> None:
        """Every offload issued so far is in its host rows: call before its entries land (become loadable,
        go to disk) and before the CPU touches host rows out of the step's copy order."""
        self.copies.settle()

    # ------------------------------------------------------------------------------ disk
    def spill(self, entry: HostEntry) -> None:
        """Hand a landed host entry the tier evicts to the disk store (queued; never blocks on disk)."""
        if self.disk is None or self.disk.contains(entry.block.key):
            return
        payload = self.pool.read_host_rows(entry.used_rows)
        b = entry.block
        record = BlockRecord(
            key=b.key,
            parent=b.parent,
            token_ids=b.token_ids,
            namespace=b.namespace,
            group_mask=tuple(r is not None for r in entry.rows),
        )
        if self.disk.put(record, payload, tag=b):  # the tag: the block KV events name once it is written
            self.traffic.spill_bytes += payload.nbytes
            self.traffic.spilled_blocks += 1

    def persist(self, kv: KVCacheManager, budget_s: float = PERSIST_BUDGET_S) -> int:
        """At shutdown: push the pool's retained blocks through the host tier to disk (write-through), a
        few at a time so the host tier never evicts an entry before its write is queued; stops after
        ``budget_s``. Returns the blocks pushed. (Only a clean stop does this: a killed process keeps on
        disk what its host tier had written.)"""
        if self.disk is None or kv.tiers is None:
            return 0
        deadline = time.monotonic() + budget_s
        step = max(1, kv.tiers.host.num_rows // (2 * max(kv.num_groups, 1)))
        pushed = 0
        while time.monotonic() < deadline and (count := kv.tiers.evict_retained(step)):
            self.flush(kv)
            pushed += count
        return pushed

    def flush(self, kv: KVCacheManager) -> None:
        """Run every host-tier move issued so far, now, and land what they filled. Before host rows are
        written out of the step's copy order (a fetch): a load issued earlier must read its rows before
        they are reused, and an offload issued earlier must not overwrite them afterwards."""
        assert kv.tiers is not None
        for kind, src, dst in kv.take_tier_moves():
            self.run(kind, src, dst)
        self.settle()
        kv.tiers.moves_landed()

    def fetch(
        self, kv: KVCacheManager, token_ids: Sequence[int], namespace: int, agree: Callable[[int], int] = int
    ) -> int:
        """Read the prompt's blocks the disk tier has (past the pool's and the host tier's) into host rows;
        returns how many. Stops at the first block the disk lacks or finds invalid. ``agree``: the number
        every TP rank read (the minimum: a rank's files may differ, its books may not)."""
        if self.disk is None or kv.tiers is None:
            return 0
        t0 = time.perf_counter()
        reads = self._read_chain(kv, token_ids, namespace)
        reads = reads[: agree(len(reads))]
        if reads:  # the rows reserved below are written now, not in the step's copy order
            self.flush(kv)
        # The prompt's own chain in the host tier is pinned too: evicting its head for its tail would
        # break the chain the fetched blocks hang from (the load would find neither).
        held = [e.block.key for e in kv.tiers.host_chain(token_ids, chain_root(namespace), None)[1]] if reads else []
        for key in held:
            kv.tiers.host.pin(key)
        entries, payloads = [], []
        for block, mask, payload in reads:  # pinned, so a later reserve never takes an earlier one's rows
            entry = kv.tiers.host.reserve(block, mask)
            if entry is None:  # deterministic on every rank: the books agree
                break
            kv.tiers.host.pin(block.key)
            entries.append(entry)
            payloads.append(payload)
        for key in held:
            kv.tiers.host.unpin(key)
        if entries:  # one indexed write per arena tensor for all the blocks
            self.pool.write_host_rows([r for e in entries for r in e.used_rows], np.concatenate(payloads))
        for entry, payload in zip(entries, payloads):
            kv.tiers.host.unpin(entry.block.key)
            kv.tiers.host.land(entry)
            kv.tiers.observer.tier_stored("CPU", entry.block)  # KV events: the host tier holds it now
            self.traffic.fetch_bytes += payload.nbytes
        fetched = len(entries)
        self.traffic.fetch_s += time.perf_counter() - t0
        self.traffic.fetched_blocks += fetched
        return fetched

    def _read_chain(
        self, kv: KVCacheManager, token_ids: Sequence[int], namespace: int
    ) -> list[tuple[TierBlock, tuple[bool, ...], np.ndarray]]:
        """The disk's valid records of the prompt's missing blocks, in chain order (at most what the host
        tier holds)."""
        assert self.disk is not None and kv.tiers is not None
        reads: list[tuple[TierBlock, tuple[bool, ...], np.ndarray]] = []
        room = kv.tiers.host.num_rows // max(kv.num_groups, 1)
        for block in kv.tiers.missing_blocks(token_ids, chain_root(namespace), None)[:room]:
            got = self.disk.get(block.key) if self.disk.contains(block.key) else None
            if got is None:
                break
            record, payload = got
            mask = tuple(record.group_mask)
            if (
                tuple(record.token_ids) != block.token_ids
                or record.parent != block.parent
                or len(mask) != kv.num_groups
                or not mask[0]
                or payload.shape[0] != sum(mask)
            ):
                self.traffic.invalid_fetches += 1
                break
            reads.append((block, mask, payload))
        return reads
