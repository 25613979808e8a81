"""A small, deterministic, offline tokenizer for engine tests.

Byte-level BPE trained on a short corpus (ASCII plus multi-byte UTF-8: ``é``, ``日本``, ``🙂``) with a
tiny merge budget, so rarer multi-byte characters stay split across several byte tokens (streaming must
hold them back). Wrapped in ``transformers.PreTrainedTokenizerFast`` with ``<s>`` (BOS, prepended by a
``TemplateProcessing`` post-processor like Llama), ``</s>`` (EOS), ``<pad>`` and an extra added special
token ``<|im_end|>``; ``<|user|>`` is added as a *non-special* added token and ``<|tool|>`` as a special
added token that ``all_special_ids`` does not list.

The trained JSON is cached per process; each call returns a fresh wrapper (callers may mutate it).
"""

from __future__ import annotations

import functools

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD, EXTRA_SPECIAL, ADDED_NON_SPECIAL = "<s>", "</s>", "<pad>", "<|im_end|>", "<|user|>"
ADDED_SPECIAL = "<|tool|>"
"""Added with ``special=True`` via ``add_tokens``: in ``added_tokens_decoder``, not ``all_special_ids``."""

CORPUS = [
    "the quick brown fox jumps over the lazy dog. the dog sleeps.",
    "hello world, hello there! the world is big and the fox is quick.",
    "café crème brûlée: les élèves étudient l'été à l'école.",
    "日本語のテキスト。日本は島国です。",
    "emoji time 🙂 and more 🙂 smiles, plus a rocket 🚀 once.",
    "numbers 0123456789 and symbols #$%&*()[]{}<>=+-_/\\|~^`@\"'",
    "a stop sequence test: END. then more text after END here.",
] * 3

VOCAB_SIZE = 256 + 4 + 60
"""Byte alphabet + the 4 special tokens + ~60 merges: common ASCII words merge, most non-ASCII don't."""


@functools.lru_cache(maxsize=1)
def _trained_json() -> str:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[PAD, BOS, EOS, EXTRA_SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok.to_str()


def make_tiny_tokenizer():
    """Fresh ``PreTrainedTokenizerFast`` over the cached trained tokenizer (deterministic)."""
    from transformers import PreTrainedTokenizerFast  # lazy: tiny_tokenizer_json() needs only `tokenizers`

    backend = Tokenizer.from_str(_trained_json())
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[EXTRA_SPECIAL],
        clean_up_tokenization_spaces=False,
    )
    hf.add_tokens([ADDED_NON_SPECIAL])
    hf.add_tokens([AddedToken(ADDED_SPECIAL, special=True)])
    return hf


def tiny_tokenizer_json() -> str:
    """The trained backend JSON (for determinism checks)."""
    return _trained_json()
