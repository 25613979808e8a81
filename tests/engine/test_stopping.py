"""Stopping criteria: LENGTH > EOS > STOP_SEQUENCE, and stop sequences only at the end of the text."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

from tgi_paged_backend.engine.stopping import StoppingCriteria, eos_token_ids
from tgi_paged_backend.engine.types import FinishReason, StoppingParams

EOS = 2


def crit(max_new_tokens=100, stop=(), ignore_eos=False, eos=(EOS,)):
    return StoppingCriteria(
        StoppingParams(max_new_tokens=max_new_tokens, stop_sequences=tuple(stop), ignore_eos_token=ignore_eos), eos
    )


def run(c, tokens):
    """Feed (id, text) pairs; the (index, reason) of the first finish, or None."""
    for i, (tid, text) in enumerate(tokens):
        r = c(tid, text)
        if r is not None:
            return i, r
    return None


def test_length_counts_generated_tokens():
    c = crit(max_new_tokens=3)
    assert c(10, "a") is None and c(11, "b") is None
    assert c(12, "c") is FinishReason.LENGTH
    assert c.current_tokens == 3


def test_max_new_tokens_one_finishes_on_first_token():
    assert crit(max_new_tokens=1)(10, "a") is FinishReason.LENGTH


def test_length_beats_eos_and_stop_sequence():
    c = crit(max_new_tokens=2, stop=["b"])
    assert c(10, "a") is None
    assert c(EOS, "b") is FinishReason.LENGTH


def test_eos_token():
    assert run(crit(), [(5, "x"), (EOS, "</s>"), (6, "y")]) == (1, FinishReason.EOS_TOKEN)


def test_ignore_eos():
    assert run(crit(max_new_tokens=4, ignore_eos=True), [(EOS, "")] * 4) == (3, FinishReason.LENGTH)


def test_eos_set_of_several_ids():
    c = crit(eos={7, 8})
    assert c(EOS, "") is None
    assert c(8, "") is FinishReason.EOS_TOKEN


def test_eos_beats_stop_sequence():
    assert run(crit(stop=["</s>"]), [(5, "x"), (EOS, "</s>")]) == (1, FinishReason.EOS_TOKEN)


def test_stop_sequence_across_tokens():
    toks = [(1, "the "), (2 + 10, "EN"), (3 + 10, ""), (4 + 10, "D")]
    assert run(crit(stop=["END"]), toks) == (3, FinishReason.STOP_SEQUENCE)


def test_stop_sequence_followed_by_more_text_in_same_token_never_matches():
    toks = [(11, "x"), (12, "END more"), (13, " text"), (14, " and"), (15, " so on")]
    assert run(crit(stop=["END"]), toks) is None


def test_stop_sequence_inside_text_later_does_not_match():
    c = crit(stop=["ab"])
    assert run(c, [(11, "a"), (12, "bc")]) is None
    assert c(13, "ab") is FinishReason.STOP_SEQUENCE


def test_stop_sequence_is_literal_not_regex():
    assert run(crit(stop=["a.c"]), [(11, "abc")]) is None
    assert run(crit(stop=["a.c"]), [(11, "xa.c")]) == (0, FinishReason.STOP_SEQUENCE)
    assert run(crit(stop=["(|)"]), [(11, "x(|)")]) == (0, FinishReason.STOP_SEQUENCE)


def test_trailing_newline_quirk_of_stock_regex():
    # re.escape(s) + "$" also matches before one final newline
    assert run(crit(stop=["```"]), [(11, "code"), (12, "```\n")]) == (1, FinishReason.STOP_SEQUENCE)
    assert run(crit(stop=["```"]), [(11, "code"), (12, "```\n\n")]) is None


def test_empty_incremental_text_is_fine_and_any_of_several_sequences():
    toks = [(11, "foo"), (12, ""), (13, ""), (14, "ba"), (15, "r")]
    assert run(crit(stop=["zzz", "bar"]), toks) == (4, FinishReason.STOP_SEQUENCE)


def test_long_output_still_matches_at_end():
    toks = [(11, "word ")] * 500 + [(12, "STOP")]
    assert run(crit(max_new_tokens=10_000, stop=["STOP"]), toks) == (500, FinishReason.STOP_SEQUENCE)


def test_stop_sequence_longer_than_stock_buffer_matches():
    seq = "x" * 250 + "!"
    toks = [(11, "y")] * 10 + [(12, "x")] * 250 + [(13, "!")]
    assert run(crit(max_new_tokens=10_000, stop=[seq]), toks) == (260, FinishReason.STOP_SEQUENCE)


class StockReference:
    """Stock StoppingCriteria, re-typed from its documented behaviour, for differential testing."""

    def __init__(self, max_new, stops, ignore_eos, eos):
        self.max_new, self.ignore_eos, self.eos = max_new, ignore_eos, eos
        self.regexes = [re.compile(f"{re.escape(s)}$") for s in stops]
        self.n, self.out = 0, ""

    def __call__(self, tid, text):
        self.n += 1
        if self.n >= self.max_new:
            return FinishReason.LENGTH
        if not self.ignore_eos and tid in self.eos:
            return FinishReason.EOS_TOKEN
        if self.regexes:
            self.out += text
            if len(self.out) > 300:
                self.out = self.out[-200:]
            if any(r.findall(self.out) for r in self.regexes):
                return FinishReason.STOP_SEQUENCE
        return None


def test_matches_stock_on_random_streams():
    rng = random.Random(0)
    alphabet = ["a", "b", "ab", "\n", "", "ba", "b\n", "xyz", " ", "a\nb", "é", "🙂"]
    for trial in range(400):
        choices = ["ab", "b\n", "aa", "\n", "zb", "🙂a", "é"]
        stops = tuple(rng.choice(choices) for _ in range(rng.randint(0, 3)))
        max_new = rng.randint(1, 60)
        ignore = rng.random() < 0.3
        ours = crit(max_new_tokens=max_new, stop=stops, ignore_eos=ignore, eos={EOS})
        ref = StockReference(max_new, stops, ignore, {EOS})
        for _ in range(250):
            tid = EOS if rng.random() < 0.03 else rng.randint(3, 50)
            text = rng.choice(alphabet)
            a, b = ours(tid, text), ref(tid, text)
            assert a == b, (trial, stops)
            if a is not None:
                break


def test_eos_token_ids_helper():
    tok = SimpleNamespace(eos_token_id=2)
    assert eos_token_ids(tok) == {2}
    assert eos_token_ids(tok, SimpleNamespace(eos_token_id=[2, 32000])) == {2, 32000}
    assert eos_token_ids(tok, SimpleNamespace(eos_token_id=5)) == {2}  # int in the config: tokenizer wins
    assert eos_token_ids(SimpleNamespace(eos_token_id=None)) == frozenset()
    assert StoppingCriteria(StoppingParams(), 2).eos_token_ids == {2}
    assert StoppingCriteria(StoppingParams(), None).eos_token_ids == frozenset()
