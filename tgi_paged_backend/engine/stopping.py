"""Per-request stopping criteria with TGI semantics (``utils/tokens.py::StoppingCriteria``).

After each generated token, in this order:

1. ``generated += 1``; ``generated >= max_new_tokens`` -> ``LENGTH`` (wins even if the token is EOS).
2. not ``ignore_eos_token`` and the id is in the EOS set -> ``EOS_TOKEN``.
3. with stop sequences: the token's *incremental* text (possibly ``""``) is appended to a rolling buffer,
   and a sequence matches only if the buffer ends with it -> ``STOP_SEQUENCE``. A token whose text holds
   the stop string followed by more characters therefore never matches.

Stock compiles ``re.escape(seq) + "$"`` and uses ``findall``; Python's ``$`` also matches just before a
single trailing ``"\\n"``, so stock stops on text ending in ``seq + "\\n"`` as well. That quirk is
reproduced (e.g. stop ``"```"`` with a final token ``"```\\n"``). An empty stop string matches at once,
as in stock.

Deviation: stock keeps the last 200-300 characters, so stop sequences longer than ~200 chars can never
match; the buffer here keeps at least ``max(300, longest stop + 1)`` characters, so they do.
"""

from __future__ import annotations

from collections.abc import Iterable

from tgi_paged_backend.engine.types import FinishReason, StoppingParams

__all__ = ["StoppingCriteria", "eos_token_ids"]

_MIN_BUFFER = 300


def eos_token_ids(tokenizer, generation_config=None) -> frozenset[int]:
    """EOS set like stock: ``generation_config.eos_token_id`` when it is a list, else the tokenizer's."""
    gen_eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(gen_eos, (list, tuple, set, frozenset)):
        if gen_eos:
            return frozenset(int(x) for x in gen_eos)
        gen_eos = None  # an empty list names no EOS: fall back to the tokenizer's
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return frozenset() if gen_eos is None else frozenset([int(gen_eos)])
    return frozenset([int(eos)])


class StoppingCriteria:
    """One request's stopping state. Call once per generated token, in order."""

    __slots__ = (
        "max_new_tokens",
        "stop_sequences",
        "ignore_eos_token",
        "eos_token_ids",
        "current_tokens",
        "_buffer",
        "_keep",
        "_suffixes",
    )

    def __init__(self, params: StoppingParams, eos_token_ids: Iterable[int] | int | None) -> None:
        if eos_token_ids is None:
            eos: frozenset[int] = frozenset()
        elif isinstance(eos_token_ids, int):
            eos = frozenset([eos_token_ids])
        else:
            eos = frozenset(int(x) for x in eos_token_ids)
        self.max_new_tokens = params.max_new_tokens
        self.stop_sequences = tuple(params.stop_sequences)
        self.ignore_eos_token = params.ignore_eos_token
        self.eos_token_ids = eos
        self.current_tokens = 0
        self._buffer = ""
        longest = max((len(s) for s in self.stop_sequences), default=0)
        self._keep = max(_MIN_BUFFER, longest + 1)
        # ``re.escape(s) + "$"``: matches at the very end, or just before one final newline.
        self._suffixes = tuple({x for s in self.stop_sequences for x in (s, s + "\n")})

    @property
    def output_tail(self) -> str:
        """The rolling text buffer (for debugging)."""
        return self._buffer

    def __call__(self, token_id: int, token_text: str) -> FinishReason | None:
        """Account one generated token and its incremental text; the finish reason, or ``None``."""
        self.current_tokens += 1
        if self.current_tokens >= self.max_new_tokens:
            return FinishReason.LENGTH
        if not self.ignore_eos_token and int(token_id) in self.eos_token_ids:
            return FinishReason.EOS_TOKEN
        if self._suffixes:
            buf = self._buffer + token_text
            if len(buf) > self._keep:
                buf = buf[-self._keep :]
            self._buffer = buf
            if buf.endswith(self._suffixes):
                return FinishReason.STOP_SEQUENCE
        return None
