"""StepRecord validation and StepRecordBuilder over the engine's real plan/output/memory objects."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from telemetry_samples import REPO_ROOT, memory_stats

from tgi_paged_backend.engine.scheduler import PreemptionEvent, StepPlan
from tgi_paged_backend.memory.kv_cache_manager import KVCacheManager
from tgi_paged_backend.telemetry.engine_adapter import StepRecordBuilder
from tgi_paged_backend.telemetry.step_record import MemoryBudget, PreemptionRecord, StepRecord


@dataclass
class Req:
    """The RequestState fields the builder reads."""

    is_preempted: bool = False
    preempted_at: float | None = None
    waiting_for_blocks: bool = False

    @property
    def is_waiting(self) -> bool:
        return self.waiting_for_blocks


def _output(computed: int, recomputed: int = 0) -> SimpleNamespace:
    """Stands in for ``engine.model_step.StepOutput`` (importing it loads torch + transformers: slow)."""
    return SimpleNamespace(num_computed_tokens=computed, num_recomputed_tokens=recomputed)


def test_step_output_still_has_the_fields_the_builder_reads() -> None:
    tree = ast.parse((REPO_ROOT / "tgi_paged_backend/engine/model_step.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StepOutput"]
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    assert {"num_computed_tokens", "num_recomputed_tokens"} <= fields


def test_builder_reads_plan_output_and_memory() -> None:
    kv = KVCacheManager(num_blocks=17, block_size=16, num_swap_blocks=8)
    kv.add_request(1, virtual_blocks=[3, 4])
    kv.match_prefix(1, list(range(20)))  # 20 prompt tokens looked up, none cached
    plan = StepPlan(
        scheduled=[(object(), 20), (object(), 1)],
        copy_ops=[("out", [5, 6], [0, 1]), ("cow", [2], [7]), ("in", [3], [9])],
        preemptions=[PreemptionEvent(request_id=9, mode="swap", num_tokens=32, estimated_cost_s=0.5)],
        resumed_wait_s=[1.25],
        num_new_blocks=2,
    )
    builder = StepRecordBuilder(clock=lambda: 100.0)
    record = builder.build(
        plan=plan,
        out=_output(21, 4),
        memory=kv.stats(),
        step_s=0.03,
        swap_block_bytes=1000,
        requests=[Req(), Req(waiting_for_blocks=True), Req(True, 97.0), Req(True, 99.5), Req(True, None)],
    )

    assert record.phase == "prefill"  # one request computed 20 tokens
    assert (record.batch_size, record.tokens_computed, record.tokens_recomputed) == (2, 21, 4)
    assert (record.swap_out_bytes, record.swap_in_bytes, record.blocks_allocated) == (2000, 1000, 2)
    assert record.preemptions == (PreemptionRecord(mode="swap", victim_id=9, tokens_lost=32, estimated_cost_s=0.5),)
    assert record.resumed_wait_s == (1.25,)
    assert (record.num_running, record.num_preempted, record.max_preempted_wait_s) == (1, 3, 3.0)
    assert record.num_waiting == 1  # blocked on KV blocks: not also running
    assert (record.prefix_query_tokens, record.prefix_hit_tokens) == (20, 0)
    assert record.memory.num_reserved_slots == 32

    # the next step sees only what was looked up since
    kv.add_request(2)
    kv.match_prefix(2, list(range(7)))
    decode = builder.build(
        plan=StepPlan(scheduled=[(object(), 1)]),
        out=_output(1),
        memory=kv.stats(),
        step_s=0.01,
        swap_block_bytes=1000,
        requests=[Req()],
    )
    assert decode.phase == "decode"
    assert (decode.prefix_query_tokens, decode.prefix_hit_tokens, decode.max_preempted_wait_s) == (7, 0, 0.0)

    # Warmup rebuilt the memory manager: its counters restart; the delta is the new cumulative value
    fresh = memory_stats(num_prefix_query_tokens=5, num_prefix_hit_tokens=3)
    after = builder.build(plan=StepPlan(), out=_output(0), memory=fresh, step_s=0.0, swap_block_bytes=1000, requests=[])
    assert (after.prefix_query_tokens, after.prefix_hit_tokens, after.batch_size) == (5, 3, 0)


def test_records_reject_impossible_values() -> None:
    with pytest.raises(ValueError, match="phase"):
        StepRecord(phase="warmup", step_s=0.1, batch_size=1, tokens_computed=1, memory=memory_stats())
    with pytest.raises(ValueError, match="step_s"):
        StepRecord(phase="decode", step_s=-1.0, batch_size=1, tokens_computed=1, memory=memory_stats())
    with pytest.raises(ValueError, match="step part 'lunch'"):
        StepRecord(
            phase="decode", step_s=0.1, batch_size=1, tokens_computed=1, part_s=(("lunch", 0.1),), memory=memory_stats()
        )
    with pytest.raises(ValueError, match="step part 'forward'"):
        StepRecord(
            phase="decode",
            step_s=0.1,
            batch_size=1,
            tokens_computed=1,
            part_s=(("forward", -0.1),),
            memory=memory_stats(),
        )
    with pytest.raises(ValueError, match="mode"):
        PreemptionRecord(mode="drop", victim_id=1, tokens_lost=1, estimated_cost_s=0.0)
    with pytest.raises(ValueError, match="pool_bytes"):
        MemoryBudget(device_total_bytes=1, weights_bytes=1, activation_peak_bytes=1, pool_bytes=-1, swap_bytes=0)


def test_records_are_frozen() -> None:
    record = StepRecord(phase="decode", step_s=0.1, batch_size=1, tokens_computed=1, memory=memory_stats())
    with pytest.raises(AttributeError):
        record.batch_size = 2  # type: ignore[misc]
