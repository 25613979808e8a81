"""The grammar pieces alone: token bytes, masks, the compile cache and its errors."""

from __future__ import annotations

import json
import threading
import time

import outlines_core
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from tests.helpers.tiny_models import make_tiny_tokenizer
from tgi_paged_backend.engine.grammar import (
    GrammarCompiler,
    TokenVocabulary,
    apply_grammar_masks,
    grammar_regex,
    token_bytes,
)
from tgi_paged_backend.engine.types import GrammarSpec, InvalidRequestError

TEXTS = ["the quick brown fox", "café crème, 日本 🙂", '{"a": [1, 2.5], "b": null}\n\tend']


def sentencepiece_like_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Llama-2 style: ``▁`` for spaces, ``<0xNN>`` byte-fallback tokens in the vocabulary (not special)."""
    chars = ["\u2581"] + [chr(c) for c in range(33, 127)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({c: len(vocab) + i for i, c in enumerate(chars)})
    merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize(
    "make", [make_tiny_tokenizer, sentencepiece_like_tokenizer], ids=["byte_level", "sentencepiece"]
)
def test_token_bytes_spell_the_text_back(make):
    tokenizer = make()
    table = token_bytes(tokenizer)
    assert tokenizer.eos_token_id not in table and tokenizer.bos_token_id not in table  # specials left out
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(table[i] for i in ids) == text.encode(), (text, tokenizer.convert_ids_to_tokens(ids))


def test_masks_forbid_exactly_what_the_automaton_forbids():
    tokenizer = make_tiny_tokenizer()
    vocab = TokenVocabulary(tokenizer, tokenizer.eos_token_id)
    index = outlines_core.Index(r'\{"k": (true|false)\}', vocab.vocabulary)
    guides = [outlines_core.Guide(index) for _ in range(2)]
    guides[1].advance(tokenizer.convert_tokens_to_ids("{"))

    class State:  # what apply_grammar_masks needs of a GrammarState
        def __init__(self, guide):
            self._guide = guide

        def guide(self):
            return self._guide

    logits = torch.randn(3, 512)  # the model's vocabulary is wider than the tokenizer's (320)
    before = logits.clone()
    apply_grammar_masks(logits, [0, 2], [State(g) for g in guides])
    assert torch.equal(logits[1], before[1])  # unconstrained row untouched
    for row, guide in ((0, guides[0]), (2, guides[1])):
        allowed = set(guide.get_tokens())
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == allowed and max(allowed) < 320
        assert torch.equal(logits[row][sorted(allowed)], before[row][sorted(allowed)])


def test_draft_masks_walk_the_automaton_and_step_back(compiler):
    """Speculative verification: row ``i`` gets the mask after ``draft[:i]``; a forbidden draft token cuts
    the valid draft there; EOS is valid only where the automaton accepts, and ends the draft; the
    automaton is back where it was afterwards."""
    tok = make_tiny_tokenizer()
    ids = [tok.convert_tokens_to_ids(t) for t in ("{", "k", "}")]
    eos = tok.eos_token_id
    state = compiler.start(1, GrammarSpec("regex", r"\{k+\}"))
    assert state.valid_draft(ids) == []  # no token constrained yet: no drafting
    guide = state.guide()
    before = sorted(guide.get_tokens())
    assert state.valid_draft(ids) == ids
    assert state.valid_draft([ids[0], ids[2], ids[1]]) == [ids[0]]  # "{}" is not allowed
    assert state.valid_draft([*ids, eos, ids[1]]) == [*ids, eos]
    assert state.valid_draft([ids[0], eos]) == [ids[0]]  # EOS before the text is complete
    assert sorted(guide.get_tokens()) == before

    words = (512 + 31) // 32
    draft = [ids[0], ids[1], ids[0]]  # the second "{" is forbidden: rows 3 repeats row 2
    logits = torch.zeros(4, 512)
    apply_grammar_masks(logits, [0, 1, 2, 3], [state], [draft])
    reference = outlines_core.Guide(compiler.submit(r"\{k+\}").result())
    expected = [set(reference.get_tokens())]
    reference.advance(ids[0], return_tokens=False)
    expected.append(set(reference.get_tokens()))
    reference.advance(ids[1], return_tokens=False)
    expected += [set(reference.get_tokens())] * 2
    for row, allowed in enumerate(expected):
        assert set(torch.isfinite(logits[row]).nonzero().flatten().tolist()) == allowed, f"row {row}"
    assert sorted(guide.get_tokens()) == before and words == 16


def test_json_schema_regex_is_outlines_cores_and_bad_schemas_are_invalid():
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    assert grammar_regex(GrammarSpec("json", schema)) == outlines_core.json_schema.build_regex_from_schema(schema)
    assert grammar_regex(GrammarSpec("regex", "[a-z]+")) == "[a-z]+"
    for bad in ('{"type": 5}', "not json"):
        with pytest.raises(InvalidRequestError, match="invalid JSON schema"):
            grammar_regex(GrammarSpec("json", bad))


@pytest.fixture
def compiler():
    tokenizer = make_tiny_tokenizer()
    c = GrammarCompiler(TokenVocabulary(tokenizer, tokenizer.eos_token_id), cache_size=2)
    yield c
    c.close()


def test_compile_cache_is_bounded_lru_and_counts_hits(compiler):
    a, b, c = (compiler.submit(r) for r in ("a+", "b+", "c+"))  # "a+" evicted by "c+"
    assert all(f.result(10) is not None for f in (a, b, c))
    assert compiler.submit("b+") is b and compiler.cache_hits == 1
    assert compiler.submit("a+") is not a and compiler.cache_hits == 1  # recompiled
    assert len(compiler.take_compile_seconds()) >= 3 and compiler.take_compile_seconds() == ()


def test_a_bad_regex_names_its_request_and_is_not_cached(compiler):
    with pytest.raises(InvalidRequestError, match=r"request 7: invalid grammar regex"):
        compiler.start(7, GrammarSpec("regex", "(unclosed"))
    with pytest.raises(InvalidRequestError, match=r"request 8: invalid JSON schema"):
        compiler.start(8, GrammarSpec("json", "{"))
    with pytest.raises(InvalidRequestError, match=r"request 9: invalid grammar regex"):
        compiler.start(9, GrammarSpec("regex", "(unclosed"))
    assert compiler.cache_hits == 0


def test_start_does_not_wait_for_a_long_compile(compiler, monkeypatch):
    gate = threading.Event()
    compile_ = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda regex: (gate.wait(30), compile_(regex))[1])
    t0 = time.perf_counter()
    state = compiler.start(1, GrammarSpec("regex", "[0-9]+"))
    assert time.perf_counter() - t0 < 5 and not state.ready
    gate.set()
    state.guide()  # blocks until compiled
    assert state.ready and state.guide().get_tokens()
