"""A 2-request end-to-end smoke run on a tiny model, and the planner's pool against a real shard's.

The shard is spawned as the launcher does, without ``TGI_PAGED_NUM_BLOCKS``, so it sizes its pool
from memory (on CPU: ``memory_fraction x available RAM - activations``); the planner, given the same
fraction, prefill budget and model, must predict that pool. Available RAM moves between the two
reads (other processes), hence the tolerance.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from integration.bench_e2e import (
    E2EConfig,
    E2EReport,
    build_prompts,
    format_report,
    recommend,
    run_contiguous,
    run_shard_mode,
)
from tgi_paged_backend.planning.plan import PlanInputs
from tgi_paged_backend.planning.planner import make_plan
from tgi_paged_backend.planning.workload import TraceRequest

pytestmark = pytest.mark.slow

TRACE = (TraceRequest(12, 5, 0.0, 16), TraceRequest(9, 3, 0.0, 16))
FRACTION = 0.002


def test_shard_pool_matches_the_planner_and_e2e_plumbing_works(tiny_llama_dir: Path) -> None:
    import transformers

    cfg = E2EConfig(
        model_dir=tiny_llama_dir,
        trace=TRACE,
        num_blocks=None,
        block_size=16,
        max_input_tokens=64,
        max_batch_prefill_tokens=64,
        scrape_interval_s=0.05,
        ready_timeout_s=120,
        extra_env=(("TGI_PAGED_MEMORY_FRACTION", str(FRACTION)),),
    )
    prompts = build_prompts(transformers.AutoTokenizer.from_pretrained(tiny_llama_dir), TRACE)
    plan = make_plan(
        PlanInputs(
            model=str(tiny_llama_dir),
            device="cpu",
            memory_fraction=FRACTION,
            block_size=16,
            max_prefill_tokens=64,
            max_input_tokens=64,
            max_total_tokens=80,
            overcommits=(2.0,),
        ),
        TRACE,
    )
    result = run_shard_mode(cfg, prompts, 2.0, mode="paged", log=lambda *_: None)

    assert result.pool_tokens == pytest.approx(plan.physical_tokens, rel=0.15)
    assert result.useful_tokens == 8 and result.tokens_per_s > 0
    assert result.peak_admitted == 2 and result.preemptions == {"recompute": 0, "swap": 0}
    assert 0 <= result.waste_total <= 1 and result.ttft_p50_s > 0

    contiguous = run_contiguous(
        E2EConfig(model_dir=tiny_llama_dir, trace=TRACE, num_blocks=5, block_size=16), prompts, log=lambda *_: None
    )
    assert contiguous.useful_tokens == 8 and contiguous.peak_admitted == 2  # 2 x (12 + 16) <= 64 slots
    assert recommend([contiguous, result])[0] == 2.0
    text = format_report(
        E2EReport(
            {
                "requests": 2,
                "prompt_mean": 10.5,
                "output_mean": 4,
                "max_new_tokens": 16,
                "kv_tokens": 64,
                "num_blocks": 5,
                "block_size": 16,
                "cpu_count": 2,
                "threads": 1,
            },
            [contiguous, result],
            2.0,
            "test",
            1.0,
        )
    )
    assert "tokens/s" in text and "paged oc 2" in text
