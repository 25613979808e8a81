"""Admitted concurrency end to end with KV layer groups on and off, on the same pool bytes (issue 24).

:func:`compare_layer_groups` drives the real shard engine (:class:`~tgi_paged_backend.engine.shard_engine.
PagedShardEngine`) through the router protocol twice on one model that mixes sliding-window and
full-attention layers: with one page map per KV layer group (``TGI_PAGED_LAYER_GROUPS=1``, a block holds
``layers_per_block`` layers) and with one page map for all layers (``TGI_PAGED_LAYER_GROUPS=0``, a block
holds every layer, so the same bytes are fewer blocks). Each run: Warmup as the router sends it, then
:class:`RouterLoop` plays the v3 router with chunking -- every request queued at once, admitted in order
while its whole booking (``prompt + max_new_tokens - 1`` slots) fits the router's virtual blocks and the
prefill budget, the new ones prefilled together with the running batch, finished ones filtered out --
until every request is done. Greedy, so the two runs must generate the same tokens.

What is counted (counts, not timings): Warmup's advertised budget (``max_batch_total_tokens``), the most
requests that computed a token in one step (preempted requests compute nothing), preemptions, steps
(Prefill and Decode calls) to finish, and the most pool blocks (and bytes) in use after a step.

The model is the caller's: ``examples/bench_layer_groups.py`` writes a tiny random Gemma 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tgi_paged_backend.engine.types import (
    BatchSpec,
    CachedBatchInfo,
    RequestSpec,
    SamplingParams,
    StepResult,
    StoppingParams,
)
from tgi_paged_backend.planning.report import fmt_bytes, table


@dataclass(frozen=True, slots=True)
class Workload:
    """The requests (all queued at once) and the router's settings."""

    prompts: tuple[str, ...]
    max_new_tokens: int
    block_size: int
    max_prefill_tokens: int = 32
    """``--max-batch-prefill-tokens``: the router's prefill budget per step, and Warmup's chunk bound."""
    overcommit: float = 1.0
    """``TGI_PAGED_OVERCOMMIT``: 1 makes the router book every request's worst case against the physical
    pool (what it admits is what the pages hold, never preempted); more lets it admit more and the shard
    preempt when the pages run out."""


@dataclass(slots=True)
class RunResult:
    """One run of the workload on one engine."""

    layer_groups: bool
    num_groups: int
    layers_per_block: int
    num_blocks: int
    """Pool blocks, scratch block included."""
    block_bytes: int
    advertised_tokens: int
    """Warmup's ``max_supported_total_tokens`` (the router's ``max_batch_total_tokens``)."""
    physical_tokens: int
    budget_gain: float
    peak_running: int = 0
    """Most requests that computed a token in one step."""
    generated: int = 0
    steps: int = 0
    """Prefill and Decode calls until every request finished."""
    preemptions: dict[str, int] = field(default_factory=dict)
    peak_blocks: int = 0
    """Most pool blocks in use after a step."""
    reclaimed_blocks: int = 0
    """Blocks the sliding groups gave back behind their windows over the run."""
    tokens: dict[int, list[int]] = field(default_factory=dict)

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def peak_bytes(self) -> int:
        return self.peak_blocks * self.block_bytes

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    @property
    def mean_running(self) -> float:
        """Tokens generated per step: the mean number of requests computing."""
        return self.generated / max(self.steps, 1)


@dataclass(frozen=True, slots=True)
class Comparison:
    workload: Workload
    on: RunResult
    off: RunResult

    @property
    def same_tokens(self) -> bool:
        return self.on.tokens == self.off.tokens


def build_bench_engine(model_dir: Path | str, *, num_blocks: int, block_size: int, layer_groups: bool, **env: str):
    """A shard engine on ``model_dir`` with a pool of ``num_blocks`` blocks (scratch included), greedy
    runs, no prefix caching (every prompt differs), recompute preemption, no speculation."""
    from tgi_paged_backend.engine import build_engine
    from tgi_paged_backend.envs import build_config
    from tgi_paged_backend.model_files import with_local_model

    settings = {
        "TGI_PAGED_NUM_BLOCKS": str(num_blocks),
        "TGI_PAGED_BLOCK_SIZE": str(block_size),
        "TGI_PAGED_PREEMPTION": "recompute",
        "TGI_PAGED_LAYER_GROUPS": "1" if layer_groups else "0",
        "PREFIX_CACHING": "0",
        **env,
    }
    config = build_config({"model_id": str(model_dir), "speculate": 0}, settings)
    return build_engine(with_local_model(config))


def warmup(engine: Any, *, max_input_tokens: int, max_total_tokens: int, max_prefill_tokens: int) -> int:
    """The router's Warmup (one batch of ``max_prefill_tokens`` prompt tokens); returns the advertised budget."""
    requests, n = [], 0
    while n < max_prefill_tokens:
        truncate = min(max_prefill_tokens - n, max_input_tokens)
        requests.append(
            RequestSpec(
                id=0,
                text="_test " * truncate,
                truncate=truncate,
                stopping=StoppingParams(max_new_tokens=max_total_tokens - truncate, ignore_eos_token=True),
            )
        )
        n += truncate
    batch = BatchSpec(id=0, requests=tuple(requests), max_tokens=max_input_tokens)
    result = engine.warmup(
        batch,
        max_input_tokens=max_input_tokens,
        max_prefill_tokens=max_prefill_tokens,
        max_total_tokens=max_total_tokens,
    )
    return int(result.max_supported_total_tokens)


class RouterLoop:
    """The v3 router's side, reduced to what admission needs: its block allocator over the advertised
    budget (virtual ids, block 0 kept for health checks), admission in queue order while the booking fits
    and the batch is not braking, Prefill with the cached batch (chunking), FilterBatch of finished ones."""

    def __init__(self, engine: Any, workload: Workload, advertised_tokens: int) -> None:
        self.engine = engine
        self.workload = workload
        self.block_size = workload.block_size
        self.supported = advertised_tokens
        self.free = list(range(1, advertised_tokens // self.block_size))
        self.entries: dict[int, RequestSpec] = {}
        self.tokens: dict[int, list[int]] = {}
        self.steps = 0
        self.generated = 0
        self.peak_running = 0
        self.peak_blocks = 0

    def _allocate(self, num_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        need = -(-num_tokens // self.block_size)
        if need > len(self.free):
            return None
        blocks = tuple(self.free[len(self.free) - need :])
        del self.free[len(self.free) - need :]
        slots = tuple(b * self.block_size + o for b in blocks for o in range(self.block_size))[:num_tokens]
        return blocks, slots

    def _admit(self, queue: list[tuple[int, str]], running: CachedBatchInfo | None) -> list[RequestSpec]:
        if running is not None and running.max_tokens >= self.supported:
            return []  # the shard brakes (or the budget is spent)
        budget = self.workload.max_prefill_tokens - (running.current_tokens if running is not None else 0)
        new: list[RequestSpec] = []
        for rid, text in queue:
            n = len(self.engine.prompt_tokenizer.encode(text, 10_000, True))
            if n > budget:
                break
            got = self._allocate(n + self.workload.max_new_tokens - 1)
            if got is None:
                break
            budget -= n
            new.append(
                RequestSpec(
                    id=rid,
                    text=text,
                    truncate=10_000,
                    sampling=SamplingParams(),
                    stopping=StoppingParams(max_new_tokens=self.workload.max_new_tokens, ignore_eos_token=True),
                    blocks=got[0],
                    slots=got[1],
                )
            )
        return new

    def run(self, max_steps: int = 100_000) -> None:
        queue = list(enumerate(self.workload.prompts, start=1))
        running: CachedBatchInfo | None = None
        next_batch = 1
        while queue or running is not None:
            if self.steps >= max_steps:
                raise RuntimeError(f"not finished after {max_steps} steps")
            new = self._admit(queue, running) if queue else []
            if new:
                queue = queue[len(new) :]
                for r in new:
                    self.entries[r.id] = r
                    self.tokens[r.id] = []
                result = self.engine.prefill(
                    BatchSpec(id=next_batch, requests=tuple(new)), None if running is None else running.id
                )
                next_batch += 1
            elif running is not None:
                result = self.engine.decode([running.id])
            else:
                raise RuntimeError("the router cannot admit the next request on an idle pool: the budget is too small")
            running = self._absorb(result)

    def _absorb(self, result: StepResult) -> CachedBatchInfo | None:
        self.steps += 1
        self.peak_running = max(self.peak_running, len(result.generations))
        self.peak_blocks = max(self.peak_blocks, self.engine.kv.num_used_blocks)
        for g in result.generations:
            self.tokens[g.request_id].extend(g.tokens.ids)
            self.generated += len(g.tokens.ids)
            if g.generated_text is not None:
                self.free.extend(self.entries.pop(g.request_id).blocks)
        batch = result.batch
        if batch is None:
            return None
        kept = [rid for rid in batch.request_ids if rid in self.entries]
        if len(kept) == batch.size:
            return batch
        if not kept:
            self.engine.clear_cache(batch.id)
            return None
        return self.engine.filter_batch(batch.id, kept)


def run_workload(engine: Any, workload: Workload, *, layer_groups: bool) -> RunResult:
    """Warmup, then every request through :class:`RouterLoop`; the engine ends idle."""
    lengths = [len(engine.prompt_tokenizer.encode(p, 10_000, True)) for p in workload.prompts]
    advertised = warmup(
        engine,
        max_input_tokens=max(lengths),
        max_total_tokens=max(lengths) + workload.max_new_tokens,
        max_prefill_tokens=workload.max_prefill_tokens,
    )
    before = dict(engine.stats.preemptions)
    reclaimed_before = engine.kv.stats().num_reclaimed_blocks_total
    loop = RouterLoop(engine, workload, advertised)
    loop.run()
    if engine.requests or engine.kv.num_used_blocks:
        raise RuntimeError("the engine is not idle after the run")
    groups = engine.runner.kv_groups
    return RunResult(
        layer_groups=layer_groups,
        num_groups=groups.num_groups,
        layers_per_block=groups.layers_per_block,
        num_blocks=engine.capacity.num_blocks,
        block_bytes=engine.runner.block_bytes,
        advertised_tokens=advertised,
        physical_tokens=engine.capacity.physical_tokens,
        budget_gain=engine.capacity.budget_gain,
        peak_running=loop.peak_running,
        generated=loop.generated,
        steps=loop.steps,
        preemptions={k: v - before.get(k, 0) for k, v in engine.stats.preemptions.items()},
        peak_blocks=loop.peak_blocks,
        reclaimed_blocks=engine.kv.stats().num_reclaimed_blocks_total - reclaimed_before,
        tokens=loop.tokens,
    )


def compare_layer_groups(model_dir: Path | str, workload: Workload, *, pool_blocks: int) -> Comparison:
    """The workload with groups off on ``pool_blocks`` blocks of every layer (scratch included), then with
    groups on the same bytes: ``pool_blocks * (bytes of an all-layer block) // (bytes of a group block)``."""
    env = {"TGI_PAGED_OVERCOMMIT": f"{workload.overcommit:g}"}
    engine = build_bench_engine(
        model_dir, num_blocks=pool_blocks, block_size=workload.block_size, layer_groups=False, **env
    )
    runner = engine.runner
    if runner.spec.kv_groups.num_groups < 2:
        raise ValueError(f"{model_dir}: one KV layer group (no sliding layers beside full ones): nothing to compare")
    pool_bytes = pool_blocks * runner.block_bytes
    grouped_blocks = pool_bytes // runner.block_bytes_for(runner.spec.kv_groups)
    off = _run_and_close(engine, workload, layer_groups=False)
    engine = build_bench_engine(
        model_dir, num_blocks=grouped_blocks, block_size=workload.block_size, layer_groups=True, **env
    )
    on = _run_and_close(engine, workload, layer_groups=True)
    return Comparison(workload, on, off)


def _run_and_close(engine: Any, workload: Workload, *, layer_groups: bool) -> RunResult:
    try:
        return run_workload(engine, workload, layer_groups=layer_groups)
    finally:
        engine.close()


def _ratio(on: float, off: float) -> str:
    return f"{on / off:.2f}x" if off else "n/a"


def comparison_table(comparisons: Sequence[Comparison]) -> str:
    """Groups on vs off side by side, one block of rows per router setting (overcommit)."""
    rows: list[list[Any]] = []
    for c in comparisons:
        on, off = c.on, c.off
        rows.append([f"TGI_PAGED_OVERCOMMIT={c.workload.overcommit:g}", "", "", ""])
        rows += [
            ["  pool", _pool(off), _pool(on), _ratio(on.pool_bytes, off.pool_bytes)],
            [
                "  Warmup's budget (max batch total tokens)",
                off.advertised_tokens,
                f"{on.advertised_tokens} (gain x{on.budget_gain:.2f})",
                _ratio(on.advertised_tokens, off.advertised_tokens),
            ],
            [
                "  peak requests computing in one step",
                off.peak_running,
                on.peak_running,
                _ratio(on.peak_running, off.peak_running),
            ],
            [
                "  requests computing, mean per step",
                f"{off.mean_running:.2f}",
                f"{on.mean_running:.2f}",
                _ratio(on.mean_running, off.mean_running),
            ],
            ["  preemptions", off.num_preemptions, on.num_preemptions, ""],
            ["  steps to finish (Prefill + Decode calls)", off.steps, on.steps, _ratio(on.steps, off.steps)],
            [
                "  peak blocks held (bytes)",
                f"{off.peak_blocks} ({fmt_bytes(off.peak_bytes)})",
                f"{on.peak_blocks} ({fmt_bytes(on.peak_bytes)})",
                _ratio(on.peak_bytes, off.peak_bytes),
            ],
            ["  blocks given back behind the window", off.reclaimed_blocks, on.reclaimed_blocks, ""],
            ["  generated tokens identical (greedy)", "", "yes" if c.same_tokens else "NO", ""],
        ]
    return table(["", "groups off (one page map)", "groups on", "on / off"], rows)


def _pool(r: RunResult) -> str:
    layers = "all layers" if r.num_groups == 1 else f"{r.layers_per_block} layer{'s' * (r.layers_per_block > 1)}"
    return f"{r.num_blocks} x {layers} = {fmt_bytes(r.pool_bytes)}"


def describe_workload(w: Workload, num_requests: int, prompt_tokens: Sequence[int]) -> str:
    return (
        f"{num_requests} requests queued at once, prompts {min(prompt_tokens)}-{max(prompt_tokens)} tokens, "
        f"{w.max_new_tokens} new tokens each (greedy), block size {w.block_size}, "
        f"max batch prefill tokens {w.max_prefill_tokens}"
    )
