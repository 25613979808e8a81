"""Incremental detokenisation, final text, special flags, per-token texts (tiny byte-level BPE)."""

from __future__ import annotations

import random

import pytest

from tgi_paged_backend.engine.detokenize import TokenDecoder, special_token_ids

try:
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
except ImportError:  # tests/ itself on sys.path (rootdir conftest, no package __init__)
    from helpers.tiny_tokenizer import make_tiny_tokenizer

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def dec(tok):
    return TokenDecoder(tok)


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def stream(dec, prompt_ids, gen_ids):
    r = dec.new_request(prompt_ids)
    return r, [r.step(i) for i in gen_ids]


def stock_decode_token(tok, all_ids, prefix, read):
    """Stock ``Model.decode_token``, re-typed from its documented behaviour."""
    prefix_text = tok.decode(all_ids[prefix:read], skip_special_tokens=False)
    new_text = tok.decode(all_ids[prefix:], skip_special_tokens=False)
    if len(new_text) > len(prefix_text) and not new_text.endswith(FFFD):
        return new_text[len(prefix_text) :], read, len(all_ids)
    return "", prefix, read


def test_tiny_tokenizer_splits_multibyte_chars(tok):
    # the fixtures below rely on characters split across byte tokens
    for ch in ("🚀", "語", "û"):
        ids = enc(tok, ch)
        assert len(ids) >= 2, ch
        assert any(FFFD in tok.decode([i]) for i in ids)


def test_never_emits_half_a_character_and_pieces_concatenate(tok, dec):
    text = " café brûlée 🚀 日本語のテキスト 🙂 ñ END"
    prompt = tok("hello world")["input_ids"]
    r, pieces = stream(dec, prompt, enc(tok, text))
    assert all(FFFD not in p for p in pieces)
    assert "" in pieces  # something was held back
    assert "".join(pieces) == text
    assert r.final_text() == text


def test_matches_stock_decode_token_on_random_streams(tok, dec):
    rng = random.Random(0)
    vocab = len(tok)
    for _ in range(30):
        prompt = tok("the quick fox " * rng.randint(0, 3))["input_ids"]
        gen = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        ids, prefix, read = list(prompt), max(0, len(prompt) - 5), len(prompt)
        expected = []
        for g in gen:
            ids.append(g)
            t, prefix, read = stock_decode_token(tok, ids, prefix, read)
            expected.append(t)
        r, pieces = stream(dec, prompt, gen)
        assert pieces == expected
        assert (r.prefix_offset, r.read_offset) == (prefix, read)


def test_special_tokens_stream_but_not_in_final_text(tok, dec):
    gen = enc(tok, " hello world") + [tok.eos_token_id]
    r, pieces = stream(dec, tok("hi")["input_ids"], gen)
    assert pieces[-1] == "</s>"
    assert "".join(pieces) == " hello world</s>"
    assert r.final_text() == " hello world"


def test_final_text_keeps_leading_space_like_streaming(tok, dec):
    prompt = tok("hello")["input_ids"]
    gen = enc(tok, " world")
    r, pieces = stream(dec, prompt, gen)
    assert r.final_text() == "".join(pieces) == " world"
    # stock: decode([last prompt id] + generated) minus the decoded first token
    anchor = prompt[-1:]
    head = tok.decode(anchor, skip_special_tokens=True)
    expected = tok.decode(anchor + gen, skip_special_tokens=True)[len(head) :]
    assert r.final_text() == expected


def test_final_text_cut_mid_character_returns_decodable_part(tok, dec):
    ids = enc(tok, "ok 🚀")
    assert tok.decode(ids[-3:-2]) == " " + FFFD  # the space shares a token with the rocket's first byte
    for cut, streamed, final in ((1, "ok", "ok "), (2, "ok", "ok ")):
        gen = ids[:-cut]  # rocket incomplete (e.g. max_new_tokens hit)
        r, pieces = stream(dec, tok("x")["input_ids"], gen)
        assert tok.decode(gen).endswith(FFFD)  # stock would return "" for the whole text here
        assert "".join(pieces) == streamed  # the token holding " " + a partial char was held back
        assert r.final_text() == final  # every complete character is kept
    gen = enc(tok, "日本語")[:-1]
    r, pieces = stream(dec, [], gen)
    assert "".join(pieces) == "日本" == r.final_text()


def test_final_text_after_a_special_last_prompt_token(tok, dec):
    prompt = tok("hi<|im_end|>", add_special_tokens=True)["input_ids"]
    assert prompt[-1] in dec.special_ids
    gen = enc(tok, " yes 日本")
    r, pieces = stream(dec, prompt, gen)
    assert r.final_text() == "".join(pieces) == " yes 日本"


def test_short_and_empty_prompts(tok, dec):
    gen = enc(tok, "hé🙂")
    for prompt in ([], [tok.bos_token_id], tok("a b c d e f g h")["input_ids"]):
        r, pieces = stream(dec, prompt, gen)
        assert "".join(pieces) == "hé🙂" == r.final_text()
        assert r.num_generated == len(gen) and r.generated_ids == gen
    assert dec.new_request([1, 2]).final_text() == ""


def test_is_special(tok, dec):
    for t in ("<s>", "</s>", "<pad>", "<|im_end|>"):
        assert dec.is_special(tok.convert_tokens_to_ids(t)), t
    assert not dec.is_special(tok.convert_tokens_to_ids("<|user|>"))  # added, not special
    assert not dec.is_special(enc(tok, "the")[0])
    tool = tok.convert_tokens_to_ids("<|tool|>")
    assert tool not in tok.all_special_ids and dec.is_special(tool)  # special added token
    assert special_token_ids(tok) == {0, 1, 2, 3, tool}
    assert dec.is_special_many([1, 5, 3]) == [True, False, True]


def test_prefill_and_top_token_texts_are_per_token(tok, dec):
    ids = tok("hi 🚀 <|im_end|>")["input_ids"]
    texts = dec.prefill_texts(ids)
    assert texts == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert texts[0] == "<s>" and texts[-1] == "<|im_end|>"
    assert len(texts) == len(ids)
    assert dec.token_texts([ids[1], ids[1]]) == [texts[1], texts[1]]  # cached path
