"""Workload generator: documented distributions, determinism, JSONL round trip."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tgi_paged_backend.planning.workload import (
    WORKLOADS,
    TraceRequest,
    clipped_lognormal_mean,
    fit_lognormal_mu,
    generate_trace,
    load_trace,
    save_trace,
    summarize,
)

TARGETS = {"sharegpt": (161.3, 338.0), "alpaca": (19.3, 58.5), "tiny": (24.0, 20.0)}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_sampled_means_match_the_documented_targets(name: str) -> None:
    trace = generate_trace(name, 40_000, seed=11)
    s = summarize(trace)
    prompt, output = TARGETS[name]
    assert s["prompt_mean"] == pytest.approx(prompt, rel=0.03)
    assert s["output_mean"] == pytest.approx(output, rel=0.03)
    spec = WORKLOADS[name]
    assert all(spec.prompt.low <= r.prompt_tokens <= spec.prompt.high for r in trace)
    assert all(1 <= r.output_tokens <= r.max_new_tokens == spec.max_new_tokens for r in trace)


def test_clipped_mean_closed_form_matches_monte_carlo() -> None:
    rng = np.random.default_rng(0)
    mu, sigma, low, high = 5.0, 1.0, 4.0, 600.0
    sample = np.clip(rng.lognormal(mu, sigma, 400_000), low, high).mean()
    assert clipped_lognormal_mean(mu, sigma, low, high) == pytest.approx(sample, rel=0.01)
    assert clipped_lognormal_mean(fit_lognormal_mu(100.0, sigma, low, high), sigma, low, high) == pytest.approx(100.0)


def test_same_seed_same_trace_and_caps_apply() -> None:
    a = generate_trace("sharegpt", 200, seed=3)
    assert a == generate_trace("sharegpt", 200, seed=3)
    assert a != generate_trace("sharegpt", 200, seed=4)
    capped = generate_trace("sharegpt", 500, seed=3, max_new_tokens=128)
    assert max(r.output_tokens for r in capped) == 128
    assert all(r.reserved_tokens == r.prompt_tokens + 127 for r in capped)


def test_poisson_arrivals_have_the_asked_rate() -> None:
    trace = generate_trace("alpaca", 5000, arrival="poisson", rate=20.0, seed=1)
    arrivals = [r.arrival for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert len(trace) / arrivals[-1] == pytest.approx(20.0, rel=0.05)
    assert {r.arrival for r in generate_trace("alpaca", 50, arrival="burst")} == {0.0}
    with pytest.raises(ValueError, match="rate"):
        generate_trace("alpaca", 5, arrival="poisson")


def test_jsonl_round_trip_and_defaults(tmp_path) -> None:
    trace = generate_trace("tiny", 30, arrival="poisson", rate=5.0, seed=2)
    path = save_trace(tmp_path / "t.jsonl", trace)
    assert load_trace(path) == trace
    (tmp_path / "min.jsonl").write_text('{"prompt_tokens": 5, "output_tokens": 2000}\n\n')
    (loaded,) = load_trace(tmp_path / "min.jsonl", default_max_new_tokens=64)
    assert loaded == TraceRequest(5, 64, 0.0, 64)
    (tmp_path / "bad.jsonl").write_text('{"prompt_tokens": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(tmp_path / "bad.jsonl")


def test_trace_request_validates() -> None:
    with pytest.raises(ValueError):
        TraceRequest(0, 1, 0.0, 8)
    with pytest.raises(ValueError):
        TraceRequest(4, 9, 0.0, 8)
    assert math.isclose(TraceRequest(4, 8, 1.5, 8).total_tokens, 12)
