"""Prompt tokenisation: identical to stock's ``tokenizer(text, truncation=True, max_length=truncate)`` with
``truncation_side="left"``, without touching the caller's tokenizer."""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import processors

from tgi_paged_backend.engine.tokenize import PromptTokenizer

try:
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer, tiny_tokenizer_json
except ImportError:  # tests/ itself on sys.path (rootdir conftest, no package __init__)
    from helpers.tiny_tokenizer import make_tiny_tokenizer, tiny_tokenizer_json

TEXT = "the quick brown fox jumps over the lazy dog 🙂 café 日本語"


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def pt(tok):
    return PromptTokenizer(tok)


def stock(tok, text, truncate, add_special_tokens=True):
    """What stock does: a left-truncating copy called with truncation=True, max_length=truncate."""
    t = copy.deepcopy(tok)
    t.truncation_side = "left"
    return t(text, truncation=True, max_length=truncate, add_special_tokens=add_special_tokens)["input_ids"]


def test_no_truncation_when_it_fits(tok, pt):
    full = tok(TEXT)["input_ids"]
    assert pt.encode(TEXT, truncate=len(full)) == full
    assert pt.encode(TEXT, truncate=10_000) == full
    assert pt.encode(TEXT, truncate=None) == full
    assert full[0] == tok.bos_token_id


def test_truncation_keeps_the_last_tokens_and_bos_like_stock(tok, pt):
    full = tok(TEXT)["input_ids"]
    content = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert full == [tok.bos_token_id] + content
    for n in range(1, len(full) + 2):
        ids = pt.encode(TEXT, truncate=n)
        assert ids == stock(tok, TEXT, n), n
        assert len(ids) == min(n, len(full))
        if n < len(full):
            # HF truncates before adding BOS: BOS survives, the text keeps its last n-1 tokens
            assert ids == [tok.bos_token_id] + (content[-(n - 1) :] if n > 1 else [])


def test_truncation_without_special_tokens_is_plain_last_n(tok, pt):
    content = tok(TEXT, add_special_tokens=False)["input_ids"]
    for n in range(1, len(content) + 1):
        ids = pt.encode(TEXT, truncate=n, add_special_tokens=False)
        assert ids == content[-n:] == stock(tok, TEXT, n, add_special_tokens=False)


def test_callers_tokenizer_is_untouched(tok):
    before_side = tok.truncation_side
    p = PromptTokenizer(tok)
    p.encode(TEXT, truncate=3)
    assert tok.truncation_side == before_side == "right"
    assert tok.backend_tokenizer.truncation is None
    # right truncation on the caller's tokenizer still behaves as before
    assert tok(TEXT, truncation=True, max_length=3)["input_ids"] == tok(TEXT)["input_ids"][:3]


def test_batch_helper_mixed_flags_and_limits_preserve_order(tok, pt):
    texts = [TEXT, "hello world", TEXT, "", "日本"]
    truncs = [5, 100, 4, 3, 1]
    flags = [True, True, False, True, False]
    got = pt.encode_batch(texts, truncs, flags)
    assert got == [stock(tok, t, n, f) for t, n, f in zip(texts, truncs, flags)]
    reqs = [SimpleNamespace(text=t, truncate=n, add_special_tokens=f) for t, n, f in zip(texts, truncs, flags)]
    assert pt.encode_requests(reqs) == got
    assert pt.encode_batch(texts, truncs, True) == pt.encode_batch(texts, truncs, [True] * 5)


def test_never_more_than_truncate_even_when_hf_skips_truncation(tok):
    t2 = make_tiny_tokenizer()
    t2.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    p = PromptTokenizer(t2)
    assert p.encode(TEXT, truncate=2) == stock(t2, TEXT, 2) == [1, 2]
    assert p.encode(TEXT, truncate=3)[0] == 1 and p.encode(TEXT, truncate=3)[-1] == 2
    assert len(stock(t2, TEXT, 1)) > 1  # HF silently skips truncation when max_length < added tokens
    assert len(p.encode(TEXT, truncate=1)) == 1


def test_concurrent_use_is_consistent(tok, pt):
    expected = {n: stock(tok, TEXT, n) for n in (2, 5, 9, 1000)}
    errors = []

    def work(n):
        for _ in range(50):
            if pt.encode(TEXT, truncate=n) != expected[n]:
                errors.append(n)

    threads = [threading.Thread(target=work, args=(n,)) for n in expected for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


def test_tiny_tokenizer_is_deterministic_across_processes():
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from tests.helpers.tiny_tokenizer import tiny_tokenizer_json as j; sys.stdout.write(j())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out == tiny_tokenizer_json()
