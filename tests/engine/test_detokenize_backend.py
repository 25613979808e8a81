"""``TokenDecoder`` decodes through the ``tokenizers`` backend only where that is exactly ``tokenizer.decode``:
a fast tokenizer with transformers' own ``decode`` and no clean-up of tokenization spaces."""

from __future__ import annotations

import copy
import random

import pytest

from tgi_paged_backend.engine.detokenize import TokenDecoder, backend_decode

try:
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
except ImportError:  # tests/ itself on sys.path (rootdir conftest, no package __init__)
    from helpers.tiny_tokenizer import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def test_the_backend_serves_a_plain_fast_tokenizer_with_the_same_texts(tok) -> None:
    assert backend_decode(tok) is not None  # the path below is the backend's
    dec = TokenDecoder(tok)
    rng = random.Random(0)
    specials = sorted(tok.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))]
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (False, True):
            assert dec.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_clean_up_or_an_overridden_decode_keep_transformers_decode(tok) -> None:
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert backend_decode(cleaning) is None

    class Custom(type(tok)):  # type: ignore[misc]
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "custom"

    custom = copy.deepcopy(tok)
    custom.__class__ = Custom
    assert backend_decode(custom) is None
    assert TokenDecoder(custom).decode([5, 6], skip_special_tokens=False) == "custom"
    assert backend_decode(object()) is None
