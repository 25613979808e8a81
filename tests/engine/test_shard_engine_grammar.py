"""Grammar-constrained decoding through the engine, token for token against plain transformers with
the same outlines-core automaton as a logits mask (``grammar_reference.py``).

Mixed batches (only some rows constrained), router reservations, a pool small enough to preempt
(recompute and swap in the same run), a schema whose compile is still running while the others decode,
and a failing model step that must release everything it was handed.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import jsonschema
import outlines_core
import pytest

from tests.engine.conftest import (
    RouterBlocks,
    RouterDriver,
    make_engine,
    make_text,
    prompt_ids,
    router_spec,
    router_warmup,
)
from tests.engine.grammar_reference import ConstrainedReference
from tests.helpers.tiny_models import load_reference
from tgi_paged_backend.engine.grammar import grammar_regex
from tgi_paged_backend.engine.types import BatchSpec, FinishReason, GrammarSpec, SamplingParams

PERSON = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            "pet": {
                "type": "object",
                "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "number"}},
                "required": ["kind"],
            },
        },
        "required": ["name", "pet"],
    }
)
SMALL = json.dumps(
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
        "required": ["ok", "color"],
    }
)
GRAMMARS = {
    "person": GrammarSpec("json", PERSON),
    "small": GrammarSpec("json", SMALL),
    "date": GrammarSpec("regex", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"),
    "enum_array": GrammarSpec(
        "json", json.dumps({"type": "array", "items": {"enum": ["x", "yy"]}, "minItems": 1, "maxItems": 3})
    ),
}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    return ConstrainedReference(load_reference(tiny_llama_dir), engine.runner.tokenizer)


def constrained(engine, blocks, rid: int, grammar: str | None, max_new: int, words: int = 4):
    sampling = SamplingParams() if grammar is None else SamplingParams(grammar=GRAMMARS[grammar])
    return router_spec(engine, blocks, rid, make_text(rid, words), max_new, ignore_eos=False, sampling=sampling)


def check_against_reference(engine, driver, reference, requests) -> None:
    for r in requests:
        expected = reference(prompt_ids(engine, r.text), r.sampling.grammar, r.stopping.max_new_tokens)
        assert driver.tokens[r.id] == expected, f"request {r.id} ({r.sampling.grammar})"
        final = driver.final[r.id].generated_text
        if r.sampling.grammar is None or final.finish_reason is not FinishReason.EOS_TOKEN:
            continue
        text = final.text
        grammar = r.sampling.grammar
        if grammar.kind == "json":  # EOS only where the automaton accepts: a complete, valid document
            jsonschema.validate(json.loads(text), json.loads(grammar.value))
        assert re.fullmatch(grammar_regex(grammar), text), text


def test_mixed_batch_matches_the_reference(tiny_llama_dir, reference):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [
        constrained(engine, blocks, 1, "person", 40),
        constrained(engine, blocks, 2, None, 10),
        constrained(engine, blocks, 3, "date", 16),
        constrained(engine, blocks, 4, "small", 40),
        constrained(engine, blocks, 5, "enum_array", 20),
    ]
    driver.run(BatchSpec(id=1, requests=tuple(requests)))
    check_against_reference(engine, driver, reference, requests)
    finals = {rid: g.generated_text for rid, g in driver.final.items()}
    assert finals[3].finish_reason is FinishReason.EOS_TOKEN and len(finals[3].text) == 10  # the date's length
    assert finals[4].finish_reason is finals[5].finish_reason is FinishReason.EOS_TOKEN  # validated above
    driver.assert_idle()
    assert engine.grammar_compiler.cache_hits == 0
    # The same schemas again: served from the compiled cache.
    again = [constrained(engine, blocks, 11, "person", 40), constrained(engine, blocks, 13, "date", 16)]
    driver.run(BatchSpec(id=2, requests=tuple(again)))
    assert engine.grammar_compiler.cache_hits == 2
    check_against_reference(engine, driver, reference, again)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_automaton_and_the_tokens(tiny_llama_dir, reference, mode):
    engine = make_engine(tiny_llama_dir, num_blocks=9, preemption=mode, TGI_PAGED_OVERCOMMIT="4")
    router_warmup(engine, 64)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [
        constrained(engine, blocks, 20, "person", 30, 3),
        constrained(engine, blocks, 21, None, 24, 3),
        constrained(engine, blocks, 22, "small", 24, 3),
        constrained(engine, blocks, 23, "date", 16, 3),
    ]
    driver.run(BatchSpec(id=3, requests=tuple(requests)))
    assert engine.stats.preemptions[mode] > 0, engine.stats.preemptions
    check_against_reference(engine, driver, reference, requests)
    driver.assert_idle()
    assert engine.kv.num_swapped_blocks == 0


def test_a_compiling_grammar_holds_only_its_own_request(tiny_llama_dir, reference, monkeypatch):
    """While one schema compiles, the other requests of its batch keep getting tokens."""
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    compiler = engine.grammar_compiler
    gate = threading.Event()
    compile_ = compiler._compile

    def slow_compile(regex):
        gate.wait(30)
        return compile_(regex)

    monkeypatch.setattr(compiler, "_compile", slow_compile)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    slow, free = constrained(engine, blocks, 30, "small", 24), constrained(engine, blocks, 31, None, 6)
    batch = driver.prefill(BatchSpec(id=4, requests=(slow, free)))
    for _ in range(5):
        batch = driver.decode([batch])
    assert len(driver.tokens[31]) == 6 and driver.tokens[30] == []  # the free one finished meanwhile
    assert engine.requests[30].num_computed == 0  # waiting, holding nothing new
    gate.set()
    driver.drain(batch)
    check_against_reference(engine, driver, reference, [slow, free])
    driver.assert_idle()


def test_a_failing_step_frees_everything_it_was_handed(tiny_llama_dir, reference, monkeypatch):
    """An exception in the model step: its requests (constrained, preempted, swapped) all go, and
    the next requests are served token-exact."""
    engine = make_engine(tiny_llama_dir, num_blocks=9, preemption="swap", TGI_PAGED_OVERCOMMIT="4")
    router_warmup(engine, 64)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = [constrained(engine, blocks, rid, g, 24, 3) for rid, g in ((40, "person"), (41, None), (42, "small"))]
    batch = driver.prefill(BatchSpec(id=5, requests=tuple(requests)))
    while not any(r.is_preempted for r in engine.requests.values()):
        batch = driver.decode([batch])
    forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.decode([batch.id])
    engine.clear_cache(batch.id)  # what the router does next
    assert engine.requests == {} and engine.batches == {}
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_swapped_blocks == 0
    engine.kv.check_invariants()
    monkeypatch.setattr(engine.runner, "forward", forward)
    blocks, driver = RouterBlocks(engine), RouterDriver(engine, RouterBlocks(engine))
    again = [constrained(engine, driver.blocks, rid, g, 24, 3) for rid, g in ((50, "person"), (51, None))]
    driver.run(BatchSpec(id=6, requests=tuple(again)))
    check_against_reference(engine, driver, reference, again)
    driver.assert_idle()


def test_smollm2_answers_in_schema_and_regex(smollm2_dir):
    """A real model: the answers end where the automaton accepts, parse and validate."""
    engine = make_engine(smollm2_dir, num_blocks=64, block_size=16)
    reference = ConstrainedReference(load_reference(smollm2_dir), engine.runner.tokenizer)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    pet = json.dumps(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "species": {"enum": ["cat", "dog", "bird"]},
                "age": {"type": "integer"},
                "weight_kg": {"type": "number"},
                "toys": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
            },
            "required": ["name", "species", "age"],
        }
    )
    prompts = {
        1: ("Describe a pet cat as JSON: ", GrammarSpec("json", pet)),
        2: ("The date of the moon landing, as YYYY-MM-DD: ", GrammarSpec("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}")),
        3: ("The capital of France is", None),
    }
    requests = [
        router_spec(engine, blocks, rid, text, 80, ignore_eos=False, sampling=SamplingParams(grammar=grammar))
        for rid, (text, grammar) in prompts.items()
    ]
    driver.run(BatchSpec(id=1, requests=tuple(requests)))
    check_against_reference(engine, driver, reference, requests)
    for rid in (1, 2):
        assert driver.final[rid].generated_text.finish_reason is FinishReason.EOS_TOKEN
    driver.assert_idle()


def test_a_request_that_ignores_eos_goes_on_from_an_accepting_state(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    digits = GrammarSpec("regex", "[0-9]{1,3}")
    r = router_spec(engine, blocks, 70, make_text(70, 3), 12, ignore_eos=True, sampling=SamplingParams(grammar=digits))
    driver.run(BatchSpec(id=8, requests=(r,)))
    assert driver.final[70].generated_text.finish_reason is FinishReason.LENGTH  # never stopped by the mask
    eos = engine.runner.tokenizer.eos_token_id
    text = engine.runner.tokenizer.decode([t for t in driver.tokens[70] if t != eos])
    assert eos in driver.tokens[70] and re.fullmatch("[0-9]{1,3}", text), text
    driver.assert_idle()


SAMPLING_MODES = {
    60: SamplingParams(do_sample=True, seed=1),
    61: SamplingParams(temperature=1.7, top_k=20, seed=2),
    62: SamplingParams(top_p=0.8, typical_p=0.9, seed=3),
    63: SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, temperature=0.7, seed=4),
}


def test_every_sampling_mode_stays_inside_the_automaton(tiny_llama_dir, reference):
    """Masks come before penalties and warpers: every sampled token is one the automaton allows,
    finished answers validate, and seeded runs repeat."""
    runs = []
    for _ in range(2):
        engine = make_engine(tiny_llama_dir, num_blocks=64)
        blocks = RouterBlocks(engine)
        driver = RouterDriver(engine, blocks)
        requests = [
            dataclasses.replace(
                constrained(engine, blocks, rid, "small", 40),
                sampling=dataclasses.replace(params, grammar=GRAMMARS["small"]),
            )
            for rid, params in SAMPLING_MODES.items()
        ]
        driver.run(BatchSpec(id=7, requests=tuple(requests)))
        for r in requests:
            guide = outlines_core.Guide(reference.index(GRAMMARS["small"]))
            for token in driver.tokens[r.id]:
                assert token in guide.get_tokens(), f"request {r.id} sampled a forbidden token"
                if token != engine.runner.tokenizer.eos_token_id:
                    guide.advance(token)
            final = driver.final[r.id].generated_text
            if final.finish_reason is FinishReason.EOS_TOKEN:
                jsonschema.validate(json.loads(final.text), json.loads(SMALL))
        driver.assert_idle()
        runs.append(dict(driver.tokens))
    assert runs[0] == runs[1]
