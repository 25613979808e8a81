"""The oracle for grammar-constrained decoding: plain transformers ``generate`` (greedy) with the same
``outlines-core`` automaton applied as a logits processor, one request at a time.

Written apart from the engine's masking (``Guide.get_tokens`` here, the engine writes bitmasks), so the
two agree only if both follow the automaton.
"""

from __future__ import annotations

import outlines_core
import torch
import transformers

from tgi_paged_backend.engine.grammar import TokenVocabulary, grammar_regex
from tgi_paged_backend.engine.types import GrammarSpec


class GuideLogitsProcessor(transformers.LogitsProcessor):
    """Forbids every token the automaton does not allow next (batch of one)."""

    def __init__(self, index: outlines_core.Index, prompt_len: int) -> None:
        self.guide = outlines_core.Guide(index)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_len:
            self.guide.advance(int(input_ids[0, -1]))
        allowed = torch.tensor(self.guide.get_tokens(), dtype=torch.long)
        mask = torch.full_like(scores, -torch.inf)
        mask[:, allowed[allowed < scores.shape[1]]] = 0.0
        return scores + mask


class ConstrainedReference:
    """``reference(prompt_ids, grammar, max_new_tokens) -> token ids`` (stops at EOS, like the shard)."""

    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.vocabulary = TokenVocabulary(tokenizer, tokenizer.eos_token_id)
        self._indexes: dict[str, outlines_core.Index] = {}

    def index(self, grammar: GrammarSpec) -> outlines_core.Index:
        regex = grammar_regex(grammar)
        if regex not in self._indexes:
            self._indexes[regex] = outlines_core.Index(regex, self.vocabulary.vocabulary)
        return self._indexes[regex]

    def __call__(self, prompt_ids: list[int], grammar: GrammarSpec | None, max_new_tokens: int) -> list[int]:
        x = torch.tensor([prompt_ids])
        processors = transformers.LogitsProcessorList(
            [] if grammar is None else [GuideLogitsProcessor(self.index(grammar), len(prompt_ids))]
        )
        with torch.no_grad():
            out = self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                logits_processor=processors,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.eos_token_id,
            )
        return out[0, len(prompt_ids) :].tolist()
