"""Speculative decoding (``--speculate N``) is exact: the shard's output with drafts equals its output
without them, token for token (greedy: HF's; seeded sampling: the same seed's tokens), and the page map
keeps only accepted positions.

Drafts come from an oracle (``tests/helpers/speculation_oracle.py``: the request's true continuation,
with a wrong token planted every few steps) so that every path runs: whole drafts accepted, partial
acceptance with the rejected tail's blocks given back, a draft cut by ``max_new_tokens`` or by a stop
inside the accepted run. The n-gram proposer itself is covered by ``tests/engine/test_speculation.py``
and the SmolLM2 figures.
Scenarios: single request and mixed batch with router reservations at N = 1..4; a pool small enough to
preempt by recompute and by swap; seeded sampling; stop sequences and EOS; top-n and logprobs per id;
grammar-constrained rows and penalised rows drafting beside plain ones (greedy and seeded). Pool
invariants are checked after every RPC. Verify steps run on the native decode layers (one call per layer).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.engine.conftest import (
    RouterBlocks,
    RouterDriver,
    make_engine,
    make_text,
    prompt_ids,
    router_spec,
    spec,
)
from tests.helpers.native_steps import num_native_layers, record_steps
from tests.helpers.speculation_oracle import OracleDrafts
from tgi_paged_backend.engine import speculation
from tgi_paged_backend.engine.types import BatchSpec, GrammarSpec, SamplingParams


def _run(model_dir, requests, *, speculate=0, oracle=None, monkeypatch=None, **engine_kw):
    if oracle is not None:
        monkeypatch.setattr(speculation, "ngram_draft", oracle)  # the context manager's effect, per run
    engine = make_engine(model_dir, speculate=speculate, **engine_kw)
    driver = RouterDriver(engine, check_preempted=False)
    driver.run(BatchSpec(id=0, requests=tuple(requests)))
    driver.assert_idle()
    if oracle is not None:
        monkeypatch.undo()
    return engine, driver


def _sequences(engine, driver, requests) -> list[list[int]]:
    return [prompt_ids(engine, r.text, r.truncate) + driver.tokens[r.id] for r in requests]


@pytest.mark.parametrize("speculate", [1, 2, 4])
def test_greedy_with_drafts_equals_hf(tiny_dir, hf_greedy, monkeypatch, speculate):
    engine = make_engine(tiny_dir, num_blocks=48)
    blocks = RouterBlocks(engine)
    requests = [
        router_spec(engine, blocks, rid, make_text(rid, words), max_new)
        for rid, words, max_new in ((1, 3, 13), (2, 17, 7), (3, 9, 16))
    ]
    truth = [prompt_ids(engine, r.text) + hf_greedy(tiny_dir, prompt_ids(engine, r.text), 16) for r in requests]
    oracle = OracleDrafts(truth)
    spec_engine, driver = _run(
        tiny_dir, requests, speculate=speculate, oracle=oracle, monkeypatch=monkeypatch, num_blocks=48
    )
    for r, seq in zip(requests, truth):
        n = len(prompt_ids(engine, r.text))
        assert driver.tokens[r.id] == seq[n : n + r.stopping.max_new_tokens], f"request {r.id} differs from HF"
    stats = spec_engine.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens, "drafts were neither all accepted nor all rejected"
    assert any(len(g.tokens.ids) > 1 for gens in driver.generations.values() for g in gens)
    assert driver.num_rpcs < 1 + 16, "speculation should take fewer steps than tokens"


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_exact_under_preemption(tiny_llama_dir, hf_greedy, monkeypatch, preemption):
    requests = [spec(rid, make_text(40 + rid, words), 12) for rid, words in ((1, 5), (2, 8), (3, 4), (4, 7))]
    base, _ = _run(tiny_llama_dir, requests[:1])
    truth = [
        prompt_ids(base, r.text) + hf_greedy(tiny_llama_dir, prompt_ids(base, r.text), r.stopping.max_new_tokens)
        for r in requests
    ]
    engine, driver = _run(
        tiny_llama_dir,
        requests,
        speculate=3,
        oracle=OracleDrafts(truth, wrong_every=2),
        monkeypatch=monkeypatch,
        num_blocks=12,  # 11 usable blocks of 4 tokens: one request fits, four do not
        block_size=4,
        preemption=preemption,
    )
    assert engine.stats.preemptions[preemption] > 0, "no preemption: the test would prove nothing"
    assert engine.stats.accepted_tokens > 0
    for r, seq in zip(requests, truth):
        assert driver.tokens[r.id] == seq[len(prompt_ids(base, r.text)) :], f"request {r.id} under {preemption}"


def test_seeded_sampling_repeats_the_non_speculative_tokens(tiny_llama_dir, monkeypatch):
    sampling = SamplingParams(do_sample=True, temperature=0.8, top_k=20, seed=1234)
    requests = [
        spec(rid, make_text(rid, 6 + rid), 15, sampling=dataclasses.replace(sampling, seed=rid)) for rid in (1, 2)
    ]
    engine, plain = _run(tiny_llama_dir, requests)
    spec_engine, driver = _run(
        tiny_llama_dir,
        requests,
        speculate=4,
        oracle=OracleDrafts(_sequences(engine, plain, requests)),
        monkeypatch=monkeypatch,
    )
    assert spec_engine.stats.accepted_tokens > 0
    for r in requests:
        assert driver.tokens[r.id] == plain.tokens[r.id]
        assert driver.final[r.id].generated_text.seed == r.sampling.seed


def test_stops_inside_the_accepted_run_cut_it(tiny_llama_dir, monkeypatch):
    engine, plain = _run(tiny_llama_dir, [spec(1, make_text(5, 8), 20)])
    stop_text = plain.texts[1][9]  # the 10th token's text: a stop there ends a draft run early
    requests = [
        spec(1, make_text(5, 8), 20, stop_sequences=(stop_text,)),
        spec(2, make_text(5, 8), 6),  # max_new_tokens inside a draft run
        spec(3, make_text(5, 8), 20, ignore_eos=False),
    ]
    engine, plain = _run(tiny_llama_dir, requests)
    oracle = OracleDrafts([prompt_ids(engine, make_text(5, 8)) + plain.tokens[1] + [0] * 30], wrong_every=10**9)
    _, driver = _run(tiny_llama_dir, requests, speculate=4, oracle=oracle, monkeypatch=monkeypatch)
    for r in requests:
        assert driver.tokens[r.id] == plain.tokens[r.id], f"request {r.id}"
        assert driver.final[r.id].generated_text.finish_reason == plain.final[r.id].generated_text.finish_reason
        assert driver.final[r.id].generated_text.text == plain.final[r.id].generated_text.text


def test_logprobs_and_top_n_per_accepted_id(tiny_llama_dir, monkeypatch):
    requests = [spec(1, make_text(8, 7), 12, top_n_tokens=3)]
    engine, plain = _run(tiny_llama_dir, requests)
    _, driver = _run(
        tiny_llama_dir,
        requests,
        speculate=3,
        oracle=OracleDrafts(_sequences(engine, plain, requests)),
        monkeypatch=monkeypatch,
    )
    assert driver.tokens[1] == plain.tokens[1]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(driver.logprobs[1], plain.logprobs[1]))
    tops = [t for g in driver.generations[1] for t in g.top_tokens]
    plain_tops = [t for g in plain.generations[1] for t in g.top_tokens]
    assert [t.ids for t in tops] == [t.ids for t in plain_tops]


@pytest.mark.parametrize("sampled", [False, True])
def test_grammar_rows_draft_and_stay_exact(tiny_llama_dir, monkeypatch, sampled):
    """Grammar rows are drafted for: a draft token the automaton forbids cuts the draft before the step,
    every verified position is masked by the automaton advanced along the draft before it, and the
    automaton advances per accepted id. Output equals the non-speculative run's (greedy and seeded)."""
    seeded = dict(do_sample=True, temperature=0.9, seed=7) if sampled else {}
    digits = SamplingParams(grammar=GrammarSpec("regex", r"[0-9]{3}-[0-9]{4}( [a-z]+)*"), **seeded)
    letters = SamplingParams(grammar=GrammarSpec("regex", r"([a-z]+ ?)+"), **seeded)
    requests = [
        spec(1, make_text(1, 5), 10),
        spec(2, make_text(2, 4), 16, sampling=digits),
        spec(3, make_text(3, 9), 14, sampling=letters),
    ]
    engine, plain = _run(tiny_llama_dir, requests)
    oracle = OracleDrafts(_sequences(engine, plain, requests), wrong_every=2)
    spec_engine, driver = _run(tiny_llama_dir, requests, speculate=3, oracle=oracle, monkeypatch=monkeypatch)
    for r in requests:
        assert driver.tokens[r.id] == plain.tokens[r.id], f"request {r.id}"
    for rid in (2, 3):
        assert any(len(g.tokens.ids) > 1 for g in driver.generations[rid]), f"grammar row {rid} was not drafted"
    assert spec_engine.stats.accepted_tokens < spec_engine.stats.draft_tokens


@pytest.mark.parametrize("sampled", [False, True])
def test_penalties_draft_and_stay_exact(tiny_llama_dir, monkeypatch, sampled):
    """Repetition and frequency penalties see, at every draft position, the history up to it."""
    seeded = dict(do_sample=True, temperature=0.8, top_k=30, seed=3) if sampled else {}
    requests = [
        spec(1, make_text(11, 6), 14, sampling=SamplingParams(repetition_penalty=1.3, **seeded)),
        spec(2, make_text(12, 8), 14, sampling=SamplingParams(frequency_penalty=0.7, **seeded)),
    ]
    engine, plain = _run(tiny_llama_dir, requests)
    oracle = OracleDrafts(_sequences(engine, plain, requests))
    spec_engine, driver = _run(tiny_llama_dir, requests, speculate=3, oracle=oracle, monkeypatch=monkeypatch)
    for r in requests:
        assert driver.tokens[r.id] == plain.tokens[r.id], f"request {r.id}"
    assert 0 < spec_engine.stats.accepted_tokens < spec_engine.stats.draft_tokens


def test_cpu_drafts_only_alone_by_default(tiny_llama_dir, monkeypatch):
    """``TGI_PAGED_SPECULATE_MAX_BATCH`` unset on CPU: a batch of decoding requests does not draft, the
    last request left alone does; tokens unchanged."""
    requests = [spec(1, make_text(1, 5), 6), spec(2, make_text(2, 4), 16)]
    engine, plain = _run(tiny_llama_dir, requests)
    oracle = OracleDrafts(_sequences(engine, plain, requests), wrong_every=100)
    spec_engine, driver = _run(
        tiny_llama_dir, requests, speculate=2, oracle=oracle, monkeypatch=monkeypatch,
        TGI_PAGED_SPECULATE_MAX_BATCH="",
    )  # fmt: skip
    assert spec_engine.config.model.speculate_max_batch is None
    assert [len(g.tokens.ids) for g in driver.generations[1]] == [1] * 6  # never alone while it ran
    assert any(len(g.tokens.ids) > 1 for g in driver.generations[2])  # alone after request 1 finished
    for r in requests:
        assert driver.tokens[r.id] == plain.tokens[r.id]


def test_info_reports_speculate(tiny_llama_dir):
    assert make_engine(tiny_llama_dir, speculate=3).info().speculate == 3


@pytest.mark.parametrize("speculate", [2, 4])
def test_verify_steps_run_on_the_native_layers(tiny_llama_dir, hf_greedy, monkeypatch, speculate):
    """Every verify step (last token + draft, rows causal within the request) is one native call per layer."""
    engine = make_engine(tiny_llama_dir, speculate=speculate)
    request = spec(1, make_text(60, 6), 14)
    ids = prompt_ids(engine, request.text)
    truth = ids + hf_greedy(tiny_llama_dir, ids, 14)
    monkeypatch.setattr(speculation, "ngram_draft", OracleDrafts([truth], wrong_every=2))
    record = record_steps(engine, monkeypatch)
    driver = RouterDriver(engine, check_preempted=False)
    driver.run(BatchSpec(id=0, requests=(request,)))
    assert driver.tokens[1] == truth[len(ids) :]
    assert 0 < engine.stats.accepted_tokens < engine.stats.draft_tokens
    forwards, native = record.count(verify=True)
    assert forwards > 0 and native == forwards * num_native_layers(engine)


def test_verify_steps_run_in_the_native_stack_after_warmup(tiny_llama_dir, hf_greedy, monkeypatch):
    """After Warmup's proofs, decode and verify steps run every layer in one native call, token-exact."""
    engine = make_engine(tiny_llama_dir, speculate=3)
    engine.runner.warm_decode()
    (stack,) = engine.runner.native_layers.stacks
    assert stack.enabled and stack.verify, stack.verify_kept
    request = spec(1, make_text(60, 6), 14)
    ids = prompt_ids(engine, request.text)
    truth = ids + hf_greedy(tiny_llama_dir, ids, 14)
    monkeypatch.setattr(speculation, "ngram_draft", OracleDrafts([truth], wrong_every=2))
    record = record_steps(engine, monkeypatch)
    steps = stack.steps
    driver = RouterDriver(engine, check_preempted=False)
    driver.run(BatchSpec(id=0, requests=(request,)))
    assert driver.tokens[1] == truth[len(ids) :]
    assert 0 < engine.stats.accepted_tokens < engine.stats.draft_tokens
    forwards, native = record.count(verify=True)
    assert forwards > 0 and native == 0 and stack.steps - steps >= forwards  # no per-layer call: all stacked
