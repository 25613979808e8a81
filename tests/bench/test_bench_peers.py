"""The peer-comparison harness without any engine (``integration/peers``; the run itself is report-only).

- ``peer_traces``: burst and Poisson share the lengths (prompts 16-200, answers 16-128), only arrivals differ;
- ``figures``: tokens/s over first arrival -> last token, TTFT from each arrival, ITL between tokens, and
  greedy matches against the HF reference (the first mismatch named);
- ``format_report``: every engine that ran is a column, a skipped one is listed with its reason, the step
  anatomy is printed beside the bare forward with the overhead share, and the goals are judged (issue 21's
  table, with its floors; more of it in ``test_bench_peers_issue21.py``);
- the vLLM worker runs in another venv: it imports neither this package nor the harness.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from integration.peers.jobs import EngineResult, figures, peer_traces
from integration.peers.report import format_report
from tgi_paged_backend.planning.workload import TraceRequest
from tgi_paged_backend.telemetry.step_record import STEP_PARTS

PEERS = Path(__file__).resolve().parents[2] / "integration" / "peers"


def test_traces_share_lengths_and_respect_the_bounds() -> None:
    traces = peer_traces(32, rate=2.0, seed=0)
    burst, poisson = traces["burst"], traces["poisson"]
    assert [(r.prompt_tokens, r.output_tokens) for r in burst] == [(r.prompt_tokens, r.output_tokens) for r in poisson]
    assert all(16 <= r.prompt_tokens <= 200 and 16 <= r.output_tokens <= 128 for r in burst)
    assert {r.arrival for r in burst} == {0.0}
    arrivals = [r.arrival for r in poisson]
    assert arrivals == sorted(arrivals) and 5 < arrivals[-1] < 40  # 32 requests at 2/s


def test_figures_time_tokens_and_compare_with_the_reference() -> None:
    trace = [TraceRequest(10, 3, 0.0, 8), TraceRequest(10, 2, 1.0, 8)]
    runs = [
        {"tokens": [5, 6, 7], "arrival": 0.0, "token_times": [0.5, 1.0, 2.0]},
        {"tokens": [9, 4], "arrival": 1.0, "token_times": [1.25, 1.5]},
    ]
    fig = figures(runs, trace, reference=[[5, 6, 7], [9, 8]])
    assert fig.tokens_per_s == pytest.approx(5 / 2.0) and fig.wall_s == pytest.approx(2.0)
    assert fig.ttft_p50_s == pytest.approx((0.5 + 0.25) / 2)
    assert fig.itl_p50_s == pytest.approx(0.5)  # ITLs 0.5, 1.0, 0.25
    assert (fig.matched, fig.compared, fig.first_mismatch) == (1, 2, "request 1 at token 1")


def test_report_lists_engines_skips_and_the_anatomy_beside_the_bare_forward() -> None:
    trace = [TraceRequest(10, 2, 0.0, 8)]
    run = figures([{"tokens": [1, 2], "arrival": 0.0, "token_times": [0.1, 0.2]}], trace, reference=[[1, 2]])
    shard = EngineResult(
        engine="this shard (test)",
        runs={"burst": run, "poisson": run},
        peak_rss_bytes=2**30,
        anatomy={**dict.fromkeys(STEP_PARTS, 0.001), "forward": 0.093, "step": 0.099},
    )
    vllm = EngineResult(engine="vllm 0.0 (test)", runs={"burst": run, "poisson": run})
    skipped = EngineResult(engine="transformers continuous batching", skipped="no init_continuous_batching")
    config = {
        "requests": 1,
        "rate": 1.0,
        "threads": 2,
        "kv_tokens": 64,
        "block_size": 16,
        "max_batch_tokens": 64,
        "model": "m",
        "prompt_min": 10,
        "prompt_max": 10,
        "prompt_mean": 10.0,
        "output_min": 2,
        "output_max": 2,
        "output_mean": 2.0,
        "useful_tokens": 2,
    }
    text = format_report(
        {
            "config": config,
            "results": [shard, vllm, skipped],
            "machine": "test box",
            "bare": {"batch": 1, "context": 11, "forward_s": 0.090, "min_s": 0.089},
            "shape": {"batch": 1, "context": 11, "decode_steps": 1},
            "elapsed_s": 1.0,
        }
    )
    assert "this shard (test)" in text and "vllm 0.0 (test)" in text and "1/1 identical" in text
    assert "transformers continuous batching: skipped: no init_continuous_batching" in text
    for part in STEP_PARTS:
        assert f"\n{part} " in text
    assert "engine forward / bare forward: 1.03x" in text
    assert "engine overhead (everything but the forward): 6.00 ms = 6.1 % of the step" in text
    # issue 21's goals table (it replaced issue 14's); an old one-section report reads as the SmolLM2 section
    assert re.search(r"float32 burst tokens/s vs vLLM \(SmolLM2\)\s+1\.00x\s+>= 1\.0x\s+met\s+>= 0\.85x\s+held", text)


def test_vllm_worker_needs_only_the_stdlib_and_vllm() -> None:
    tree = ast.parse((PEERS / "vllm_worker.py").read_text())
    roots = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in (n.names if isinstance(n, ast.Import) else [n])
    }
    assert roots <= {"__future__", "json", "os", "resource", "sys", "time", "torch", "vllm"}, roots


def test_the_bare_forward_shape_survives_a_burst_shorter_than_one_metric_sample() -> None:
    """A fast host's host-bound burst (about 1 s) ends before the first metric sample, or takes one on its tail: the
    batch comes from the counts, the context from the trace (no key) unless three samples were taken, not 1 row x 1
    token (the first host E run) or "batch 1" from a tail sample (the second)."""
    from integration.peers.shard_run import _decode_shape

    sampled = {"running": [16.0, 18.0, 20.0], "used_tokens": [1600.0, 2160.0, 2000.0]}
    assert _decode_shape(sampled, 2114, 32, 127) == {"batch": 16, "context": 107}
    tail = {"running": [1.0], "used_tokens": [176.0]}
    assert _decode_shape(tail, 2114, 32, 127) == {"batch": 16}
    empty = {"running": [], "used_tokens": []}
    assert _decode_shape(empty, 2114, 32, 127) == {"batch": 16}
    assert _decode_shape(empty, 32, 32, 0) == {}


def test_the_wall_split_says_what_the_shard_steps_leave_of_the_burst() -> None:
    """The burst's wall minus the shard's decode and prefill steps is the time outside them, per decode step."""
    from integration.peers.report import wall_split

    a = {"decode_total": 0.60, "prefill_total": 0.15, "prefill_steps": 4.0}
    text = wall_split(1.00, a, 125)
    assert "decode steps 0.60 s, prefill steps 0.15 s (4 steps)" in text
    assert "outside the shard's steps 0.25 s = 2.00 ms per decode step" in text
    assert "per decode step" not in wall_split(1.00, a, "?")
