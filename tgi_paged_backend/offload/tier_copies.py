"""Where the host tier's copies run: in order on the engine thread (CPU), or on their own stream (CUDA).

The memory manager issues ``offload`` (pool blocks -> host rows) and ``load`` (host rows -> pool blocks)
moves in the step's copy order (:mod:`tgi_paged_backend.memory.prefix_tiers`); :class:`TierIO` hands each
to :meth:`TierCopies.offload` / :meth:`TierCopies.load`, and calls :meth:`TierCopies.settle` before the
entries those offloads filled are declared landed (loadable, or written to disk), and before the CPU reads
or writes host rows out of that order (a disk spill or fetch).

On CPU (:class:`InlineTierCopies`) a move is a memcpy done when it is issued: ``settle`` has nothing to wait
for. On CUDA (:class:`StreamTierCopies`) the moves run on a copy stream, ordered against the compute stream
with events so that the step waits only for what it needs:

- **offload**: the copy stream first waits for the compute stream (the blocks' latest K/V, written by
  earlier forwards and copies, is what goes out), gathers the blocks on the device and records ``gathered``;
  the compute stream waits for ``gathered`` only, so the step may overwrite those blocks (they were evicted
  to be reused) as soon as they are gathered, while the device-to-host transfer of the gathered copy runs
  beside the forward. The host rows are written when :meth:`settle` has seen that transfer finish.
- **load**: the rows are gathered on the CPU into pinned memory (they belong to landed entries, so they
  are settled), then on the copy stream, after the compute stream's earlier work (the destination blocks
  may have been read by the last forward), transferred and scattered into the pool; the compute stream
  waits for that event before anything it issues later reads the blocks.

The arena is pinned (``KVPool.allocate_host_tier``), so the transfers are asynchronous DMA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tgi_paged_backend.runner.kv_pool import KVPool


class InlineTierCopies:
    """Host-tier moves done when issued, on the calling thread (CPU pools)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def offload(self, device_ids: Sequence[int], host_rows: Sequence[int]) -> None:
        self.pool.offload(device_ids, host_rows)

    def load(self, host_rows: Sequence[int], device_ids: Sequence[int]) -> None:
        self.pool.load(host_rows, device_ids)

    def settle(self) -> None:
        """Every offload issued so far is in its host rows (nothing to wait for here)."""

    @property
    def num_in_flight(self) -> int:
        return 0


@dataclass(slots=True)
class _Transfer:
    """An offload whose device-to-host transfer may still run: ``staged`` (pinned) go to ``rows``."""

    done: torch.cuda.Event
    staged: list[torch.Tensor]
    rows: list[int]


class StreamTierCopies:
    """Host-tier moves on a copy stream of the pool's CUDA device, ordered by events (module docstring)."""

    def __init__(self, pool: KVPool) -> None:
        assert pool.device.type == "cuda", "StreamTierCopies needs a CUDA pool"
        self.pool = pool
        self.stream = torch.cuda.Stream(device=pool.device)
        self._in_flight: list[_Transfer] = []

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def offload(self, device_ids: Sequence[int], host_rows: Sequence[int]) -> None:
        device = self.pool.device
        compute = torch.cuda.current_stream(device)
        self.stream.wait_stream(compute)
        slots = self._used_on_copy_stream(self.pool.slot_tensors())
        with torch.cuda.stream(self.stream):
            index = torch.tensor(list(device_ids), dtype=torch.int64, device=device)
            gathered = [t.index_select(0, index) for t in slots]
            ready = torch.cuda.Event()
            ready.record(self.stream)
            staged = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in gathered]
            for host, dev in zip(staged, gathered):
                host.copy_(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(ready)  # later writes to these blocks wait for the gather, not for the transfer
        self._in_flight.append(_Transfer(done, staged, list(host_rows)))

    def load(self, host_rows: Sequence[int], device_ids: Sequence[int]) -> None:
        device = self.pool.device
        rows = torch.tensor(list(host_rows), dtype=torch.int64)
        staged = []
        for arena in self.pool.host_tensors():
            host = torch.empty((len(rows), *arena.shape[1:]), dtype=arena.dtype, pin_memory=True)
            torch.index_select(arena, 0, rows, out=host)
            staged.append(host)
        compute = torch.cuda.current_stream(device)
        self.stream.wait_stream(compute)
        slots = self._used_on_copy_stream(self.pool.slot_tensors())
        with torch.cuda.stream(self.stream):
            index = torch.tensor(list(device_ids), dtype=torch.int64, device=device)
            for slot, host in zip(slots, staged):  # indexed assignment: defined for fp8 caches too
                slot[index] = host.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)  # the step's reads of these blocks come after the load

    def _used_on_copy_stream(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The pool's tensors (allocated on the compute stream) are used on the copy stream: a pool rebuilt
        meanwhile must not hand their memory out before the copy stream is done with it."""
        for tensor in tensors:
            tensor.record_stream(self.stream)
        return tensors

    def settle(self) -> None:
        """Wait for the offloads' transfers issued so far and write their host rows (oldest first, so a row
        reused by a later offload ends up with the later block)."""
        transfers, self._in_flight = self._in_flight, []
        arenas = self.pool.host_tensors()
        for transfer in transfers:
            transfer.done.synchronize()
            rows = torch.tensor(transfer.rows, dtype=torch.int64)
            for arena, staged in zip(arenas, transfer.staged):
                arena[rows] = staged


TierCopies = InlineTierCopies | StreamTierCopies


def tier_copies_for(pool: KVPool) -> TierCopies:
    """The copy strategy for ``pool``'s device."""
    return StreamTierCopies(pool) if pool.device.type == "cuda" else InlineTierCopies(pool)
