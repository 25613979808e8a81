"""The stock router's request validation, replayed (what turns client parameters into a queue entry).

Checks run in the stock order and raise ``ValidationError`` with the stock messages. Tokenization
counts ``input_length`` with the model's tokenizer: ``min(len(ids), truncate)`` when the client gave
``truncate``, else ``len(ids)``; ``input_ids`` are the **last** ``input_length`` ids of the encoding
(so a leading BOS is cut by left truncation). Each scheduled leg gets at most 1024 new tokens; the
client's total (or ``max_total_tokens - input_length``) is kept for continuation legs. A JSON-schema
grammar is checked and compiled to a regex last (:mod:`.grammar`), as stock does after tokenization. For a
VLM config, markdown images become image chunks and count as their placeholder text (:mod:`.images`).
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Any

from .datatypes import GenerateParameters, ValidRequest
from .errors import ValidationError
from .grammar import SchemaGrammar, grammar_regex
from .images import MARKDOWN_IMAGE, PlaceholderRule, chunks_to_string, split_inputs

DEFAULT_GENERATION_LENGTH = 1024


@dataclass(frozen=True)
class ValidationLimits:
    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5


def load_tokenizer(tokenizer: Any) -> Any:
    """A path loads ``transformers.AutoTokenizer``; anything else is used as is."""
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    return tokenizer


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids as the router's ``tokenizers`` library computes them.

    A fast ``transformers`` tokenizer is encoded through its ``tokenizers`` backend (the same
    ``tokenizer.json`` the Rust router loads); other objects need ``encode(text, add_special_tokens=)``
    returning ids or an object with ``.ids``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    target = backend if backend is not None else tokenizer
    out = target.encode(text, add_special_tokens=add_special_tokens)
    return list(out.ids) if hasattr(out, "ids") else list(out)


class Validator:
    """``image_rule``: a VLM config's placeholder text per image (:mod:`.images`); ``None``: images are text."""

    def __init__(self, tokenizer: Any, limits: ValidationLimits, image_rule: PlaceholderRule | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.image_rule = image_rule

    async def validate(self, inputs: str, params: GenerateParameters) -> ValidRequest:
        limits = self.limits
        temperature = 1.0 if params.temperature is None else params.temperature
        if temperature <= 0.0:
            raise ValidationError("`temperature` must be strictly positive")
        repetition_penalty = 1.0 if params.repetition_penalty is None else params.repetition_penalty
        if repetition_penalty <= 0.0:
            raise ValidationError("`repetition_penalty` must be strictly positive")
        frequency_penalty = 0.0 if params.frequency_penalty is None else params.frequency_penalty
        if not -2.0 <= frequency_penalty <= 2.0:
            raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
        top_p = 1.0
        if params.top_p is not None:
            if params.top_p <= 0.0 or params.top_p >= 1.0:
                raise ValidationError("`top_p` must be > 0.0 and < 1.0")
            top_p = params.top_p
        typical_p = 1.0
        if params.typical_p is not None:
            if params.typical_p <= 0.0 or params.typical_p >= 1.0:
                raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
            typical_p = params.typical_p
        top_k = 0
        if params.top_k is not None:
            if params.top_k <= 0:
                raise ValidationError("`top_k` must be strictly positive")
            top_k = params.top_k
        if params.max_new_tokens == 0:
            raise ValidationError("`max_new_tokens` must be strictly positive")
        if len(params.stop) > limits.max_stop_sequences:
            raise ValidationError(
                f"`stop` supports up to {limits.max_stop_sequences} stop sequences. Given: {len(params.stop)}"
            )
        seed = secrets.randbits(64) if params.seed is None else params.seed
        top_n_tokens = 0
        if params.top_n_tokens is not None:
            if params.top_n_tokens > limits.max_top_n_tokens:
                raise ValidationError(
                    f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {params.top_n_tokens}"
                )
            top_n_tokens = params.top_n_tokens
        if not inputs:
            raise ValidationError("`inputs` cannot be empty")
        truncate = params.truncate
        if truncate is not None and (truncate == 0 or truncate > limits.max_input_tokens):
            raise ValidationError(
                f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. Given: {truncate}"
            )

        chunks: tuple = ()
        counted = inputs  # what input_length counts: a VLM's images as their placeholder text
        if self.image_rule is not None and MARKDOWN_IMAGE.search(inputs):
            parts, counted = await asyncio.to_thread(split_inputs, inputs, self.image_rule)
            chunks, inputs = tuple(parts), chunks_to_string(parts)
        ids = await asyncio.to_thread(encode, self.tokenizer, counted, params.add_special_tokens)
        input_length = min(len(ids), truncate) if truncate is not None else len(ids)
        if params.max_new_tokens is not None:
            max_new_tokens = min(params.max_new_tokens, DEFAULT_GENERATION_LENGTH)
            max_total_new_tokens = params.max_new_tokens
        else:
            max_total_new_tokens = max(0, limits.max_total_tokens - input_length)
            max_new_tokens = min(max_total_new_tokens, DEFAULT_GENERATION_LENGTH)
        if input_length + max_new_tokens > limits.max_total_tokens:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
                f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
            )
        if input_length > limits.max_input_tokens:
            raise ValidationError(
                f"`inputs` must have less than {limits.max_input_tokens} tokens. Given: {input_length}"
            )
        input_ids = ids[len(ids) - input_length :] if input_length else []
        grammar = params.grammar
        if isinstance(grammar, SchemaGrammar):  # compiling a large schema takes a while: off the loop
            grammar = await asyncio.to_thread(grammar_regex, grammar)

        return ValidRequest(
            inputs=inputs,
            input_ids=input_ids,
            input_length=input_length,
            truncate=truncate if truncate is not None else limits.max_input_tokens,
            add_special_tokens=params.add_special_tokens,
            decoder_input_details=params.decoder_input_details,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            typical_p=typical_p,
            do_sample=params.do_sample,
            seed=seed,
            repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty,
            watermark=params.watermark,
            grammar=grammar,
            max_new_tokens=max_new_tokens,
            max_total_new_tokens=max_total_new_tokens,
            stop_sequences=list(params.stop),
            ignore_eos_token=params.ignore_eos_token,
            top_n_tokens=top_n_tokens,
            adapter_id=params.adapter_id,
            chunks=chunks,
        )
