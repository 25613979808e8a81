"""All-greedy batches without alternatives take the native one-pass choice (``cpu_native.greedy``): the same
tokens and log-probabilities as the general path (log_softmax, argmax)."""

from __future__ import annotations

import torch

from tgi_paged_backend.engine import sampling
from tgi_paged_backend.engine.sampling import choose_next_tokens
from tgi_paged_backend.engine.types import SamplingParams


def test_the_fast_path_chooses_what_the_general_path_does(monkeypatch) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4000, generator=generator) * 4
    logits[2, 100:] = float("-inf")
    params = [SamplingParams(repetition_penalty=1.3 if i == 1 else 1.0) for i in range(5)]
    histories = [[1, 2, 3]] * 5
    fast = choose_next_tokens(logits, params, [0] * 5, histories)
    calls = []
    monkeypatch.setattr(sampling, "_greedy_in_one_pass", lambda scores: calls.append(1))
    general = choose_next_tokens(logits, params, [0] * 5, histories)
    assert calls == [1]  # asked, declined: the general path served
    assert [c.id for c in fast] == [c.id for c in general]
    for a, b in zip(fast, general):
        assert abs(a.logprob - b.logprob) < 1e-4 and a.top_ids == b.top_ids == []


def test_sampling_rows_or_alternatives_take_the_general_path(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(sampling, "_greedy_in_one_pass", lambda scores: calls.append(1))
    logits = torch.randn(2, 50)
    choose_next_tokens(logits, [SamplingParams(), SamplingParams(do_sample=True, seed=3)], [0, 0])
    out = choose_next_tokens(logits, [SamplingParams(), SamplingParams()], [0, 0], top_n=[0, 3])
    assert calls == [] and len(out[1].top_ids) == 3
