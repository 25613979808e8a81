"""The shard engine of one tensor-parallel rank (``--num-shard N``, N > 1).

The router sends every RPC to every rank with identical payloads. Each rank runs the same
:class:`~tgi_paged_backend.engine.shard_engine.PagedShardEngine` over its shard of the model
(:class:`~tgi_paged_backend.runner.parallel.tp_runner.TensorParallelRunner`), so the ranks make the same
scheduling, memory and preemption decisions as long as nothing they decide on is measured locally.
What is measured is agreed on over the control group:

- the KV budget at start-up and Warmup: the minimum over the ranks (the runner's ``available_kv_bytes``);
- the prefill rate behind the swap-vs-recompute choice: the slowest rank's step time
  (:class:`SyncedRateCalibrator`);
- sampling needs nothing: the logits are identical after the all-reduce and the seeds come from the
  router;
- which grammars have compiled (each rank compiles on its own thread): a constrained request steps
  once every rank has its automaton.

Every step starts with one small all-gather of ``[batch tag, state digest]``: the batch tag catches
RPCs that reached the ranks in a different order (the router's ``/health`` liveness Prefill runs
concurrently with its batching task), which every rank then fails in the same way
(:class:`~tgi_paged_backend.runner.parallel.process_group.RankMismatchError`); the state digest (request states and last
tokens, block tables, pool counters) catches any divergence of the page maps, which is fatal. Each rank logs both
at DEBUG level.

The router concatenates all ranks' generations, so only rank 0 reports them; the other ranks return
the same ``CachedBatch`` with an empty generations list.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable

import torch
from loguru import logger

from tgi_paged_backend.config import BackendConfig, ConfigError
from tgi_paged_backend.engine.request_state import RequestStatus
from tgi_paged_backend.engine.shard_engine import PagedShardEngine
from tgi_paged_backend.engine.types import BatchSpec, StepResult
from tgi_paged_backend.policy.preemption_mode import RateCalibrator
from tgi_paged_backend.runner.parallel.process_group import RankMismatchError, TensorParallelGroup, mark_shutting_down
from tgi_paged_backend.runner.parallel.tp_runner import TensorParallelRunner
from tgi_paged_backend.telemetry.sinks import ShardTelemetry, build_shard_telemetry

REPORTING_RANK = 0
"""The rank whose Prefill/Decode answers carry the generations."""
_STATUS_CODES = {status: code for code, status in enumerate(RequestStatus)}


class SyncedRateCalibrator(RateCalibrator):
    """A :class:`RateCalibrator` that folds in the slowest rank's measurement, so the rates (and every
    swap-vs-recompute decision made from them) are identical on all ranks. ``sync`` is a collective:
    the engine calls ``observe_*`` at the same step on every rank."""

    def __init__(self, sync: Callable[[float], float]) -> None:
        super().__init__()
        self._sync = sync

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        super().observe_prefill(num_tokens, self._sync(seconds))

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        super().observe_copy(num_bytes, self._sync(seconds))


def _digest(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return int.from_bytes(h.digest(), "big", signed=True)


class TensorParallelShardEngine(PagedShardEngine):
    """:class:`PagedShardEngine` plus the cross-rank agreements described in the module docstring."""

    def __init__(
        self, config: BackendConfig, runner: TensorParallelRunner, group: TensorParallelGroup, telemetry: ShardTelemetry
    ) -> None:
        self.group = group
        self.num_steps = 0
        """Steps run (and checked) so far, warmup included; equal on every rank."""
        super().__init__(config, runner, telemetry)
        self.calibrator = SyncedRateCalibrator(
            lambda seconds: group.max_float(seconds, "agreeing on the measured prefill time")
        )

    # -- RPCs -------------------------------------------------------------------------------

    def prefill(self, batch: BatchSpec, cached_batch_id: int | None) -> StepResult:
        return self._reported(super().prefill(batch, cached_batch_id))

    def decode(self, batch_ids: list[int]) -> StepResult:
        return self._reported(super().decode(batch_ids))

    def begin_shutdown(self) -> None:
        """Called by the server on SIGTERM (from the event loop, while an RPC may still run)."""
        mark_shutting_down()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.group.close()

    # -- cross-rank agreement ---------------------------------------------------------------

    def _reported(self, result: StepResult) -> StepResult:
        if self.group.rank == REPORTING_RANK:
            return result
        return dataclasses.replace(result, generations=[])

    def _step(self, ids: list[int], batch_id: int | None = None):
        self._check_step(ids)
        return super()._step(ids, batch_id)

    def _agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (disk-tier blocks read: each rank has its own files)."""
        return min(rank[0] for rank in self.group.all_gather_ints([value], "agreeing on disk-tier reads"))

    def _agree_ready(self, flags: list[bool]) -> list[bool]:
        """A grammar counts as compiled once every rank has it (compile times differ per rank)."""
        gathered = self.group.all_gather_ints([int(f) for f in flags], "agreeing on compiled grammars")
        return [all(rank[i] for rank in gathered) for i in range(len(flags))]

    def _check_step(self, ids: list[int]) -> None:
        """All-gather ``[batch tag, state digest]``; fail the call on a tag mismatch, exit on divergence."""
        step = self.num_steps
        self.num_steps += 1
        tag = _digest(repr(ids).encode())
        state = self.state_digest()
        logger.debug(
            "tensor parallel step {}: batch {:016x} state {:016x}", step, tag & (2**64 - 1), state & (2**64 - 1)
        )
        gathered = self.group.all_gather_ints([tag, state], "the per-step consistency check")
        if len({g[0] for g in gathered}) > 1:
            raise RankMismatchError(
                f"tensor parallel step {step}: the ranks were asked to run different batches (the RPCs "
                "reached them in a different order, e.g. the router's liveness Prefill during a Decode); "
                "failing this call on every rank"
            )
        states = [g[1] & (2**64 - 1) for g in gathered]
        if len(set(states)) > 1:
            self.group.fail(
                f"the consistency check before step {step}",
                "the ranks' request and KV block state diverged (digests by rank: "
                + ", ".join(f"{s:016x}" for s in states)
                + ")",
            )

    def state_digest(self) -> int:
        """Digest of what the scheduling decisions depend on: requests (and their last token), batches,
        block tables, pool and swap counters. Python's ``hash`` of int tuples is the same in every
        process (only str/bytes hashing is salted), and much cheaper than formatting them."""
        requests = hash(
            tuple(
                # The last sampled token too: every step is checked, so a token chosen differently
                # anywhere (the logits are meant to be bit-identical) is caught one step later.
                (
                    rid,
                    _STATUS_CODES[r.status],
                    r.num_computed,
                    len(r.output_ids),
                    r.output_ids[-1] if r.output_ids else -1,
                    r.num_preemptions,
                )
                for rid, r in sorted(self.requests.items())
            )
        )
        batches = hash(tuple(sorted((b, tuple(v)) for b, v in self.batches.items())))
        kv = self.kv
        pool = (
            kv.num_total_blocks,
            kv.num_free_blocks,
            kv.num_used_blocks,
            kv.num_retained_blocks,
            kv.num_swapped_blocks,
            kv.num_free_swap_blocks,
        )
        resident = [rid for rid in sorted(self.requests) if rid in kv]
        tables = kv.block_tables(resident).tobytes() if resident else b""
        return _digest(repr((requests, batches, pool)).encode(), tables)


def build_tensor_parallel_engine(config: BackendConfig, device: torch.device) -> TensorParallelShardEngine:
    """Join the group, load and shard the model, wait for every rank, start the heartbeat, build the engine."""
    world_size = config.server.world_size
    if device.type == "cuda":
        if torch.cuda.device_count() < world_size:
            raise ConfigError(
                f"tensor parallelism runs one rank per GPU: WORLD_SIZE={world_size} (--num-shard) but "
                f"only {torch.cuda.device_count()} GPU(s) are visible (CUDA_VISIBLE_DEVICES)"
            )
        torch.cuda.set_device(device)
    else:
        _share_cpu_threads(world_size)
    group = TensorParallelGroup.initialize(config.server, device)
    runner = TensorParallelRunner(config.model, config.cache, device, group)
    group.startup_barrier("loaded")
    group.start_heartbeat()
    try:
        names = runner.lora.names if runner.lora is not None else ()
        telemetry = build_shard_telemetry(config, device=device, adapter_names=names)
        return TensorParallelShardEngine(config, runner, group, telemetry)
    except BaseException:
        group.close()
        raise


def _share_cpu_threads(world_size: int) -> None:
    """CPU ranks on one host share its cores: left at torch's default (one thread per core), N ranks
    oversubscribe the cores N times and every collective waits on descheduled threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if torch.get_num_threads() == cores:  # not chosen by the user (OMP_NUM_THREADS)
        torch.set_num_threads(max(1, cores // world_size))
        logger.info(f"Tensor parallel on CPU: {torch.get_num_threads()} torch thread(s) per rank ({cores} cores)")
