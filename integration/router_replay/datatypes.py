"""Plain data types of the router replay: request parameters, validated requests, stream events."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from .allocator import BlockAllocation
from .grammar import SchemaGrammar

FINISH_REASONS = {0: "length", 1: "eos_token", 2: "stop_sequence"}
"""``FinishReason`` enum values the stock router accepts, with its JSON names."""


@dataclass
class GenerateParameters:
    """The TGI ``GenerateParameters`` fields the replay schedules (``None`` = not given by the client).

    ``ignore_eos_token`` does not exist in the HTTP API (the stock router always sends ``false``);
    it is here so tests can force length-bounded generations.
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    seed: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] = field(default_factory=list)
    truncate: int | None = None
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    watermark: bool = False
    grammar: str | SchemaGrammar | None = None
    """A regex, or a JSON-schema grammar that validation compiles to one (the shard only sees regexes)."""
    adapter_id: str | None = None
    add_special_tokens: bool = True
    ignore_eos_token: bool = False


@dataclass
class ValidRequest:
    """What validation hands to the queue (the stock ``ValidGenerateRequest``)."""

    inputs: str
    input_ids: list[int]
    input_length: int
    truncate: int
    add_special_tokens: bool
    decoder_input_details: bool
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    do_sample: bool
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    watermark: bool
    grammar: str | None
    max_new_tokens: int
    max_total_new_tokens: int
    stop_sequences: list[str]
    ignore_eos_token: bool
    top_n_tokens: int
    adapter_id: str | None
    chunks: tuple[Any, ...] = ()
    """For a VLM config: the text and ``images.ImageChunk`` chunks in order (empty: one text chunk)."""


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    logprob: float
    special: bool


@dataclass(frozen=True)
class PrefillToken:
    id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class PrefillEvent:
    """Prompt tokens with logprobs; only when the shard sends ``prefill_tokens``.

    Not a token: the stock HTTP layer does not emit it, but it still counts in the SSE ``index``.
    """

    tokens: tuple[PrefillToken, ...]


@dataclass(frozen=True)
class TokenEvent:
    id: int
    text: str
    logprob: float
    special: bool
    top_tokens: tuple[Token, ...]

    @property
    def token(self) -> Token:
        return Token(self.id, self.text, self.logprob, self.special)


@dataclass(frozen=True)
class FinalEvent(TokenEvent):
    """The last token of a request, with the request's result.

    ``generated_tokens`` and ``generated_text`` span every continuation leg; ``seed`` is what the
    shard reported (set only when it sampled); ``prefill`` is the last ``PrefillEvent``'s tokens
    (empty when none came); ``input_length`` is the router's count for the first leg.
    """

    generated_text: str
    finish_reason: str
    generated_tokens: int
    seed: int | None
    prefill: tuple[PrefillToken, ...]
    input_length: int
    queued: float
    start: float


StreamEvent = PrefillEvent | TokenEvent | FinalEvent


@dataclass(frozen=True)
class GeneratedText:
    text: str
    generated_tokens: int
    finish_reason: str
    seed: int | None


@dataclass(frozen=True)
class Intermediate:
    token: Token
    top_tokens: tuple[Token, ...]


@dataclass(frozen=True)
class End:
    token: Token
    top_tokens: tuple[Token, ...]
    generated_text: GeneratedText
    queued: float
    start: float


@dataclass(frozen=True)
class Failure:
    error: BaseException


_CLOSED = object()


class ResponseChannel:
    """The per-request channel between the batching loop and the client stream.

    ``closed`` mirrors ``response_tx.is_closed()``: the client went away. The batching loop only
    notices it at the request's next Generation (or when the queue pops it), as the stock router.
    """

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = False
        self.sender_dropped = False

    def send(self, item: Any) -> bool:
        if self.closed:
            return False
        self._queue.put_nowait(item)
        return True

    def drop_sender(self) -> None:
        if not self.sender_dropped:
            self.sender_dropped = True
            self._queue.put_nowait(_CLOSED)

    def close(self) -> None:
        self.closed = True

    async def recv(self) -> Any | None:
        """Next item, or ``None`` once the sender is gone and everything was read."""
        item = await self._queue.get()
        if item is _CLOSED:
            self._queue.put_nowait(_CLOSED)
            return None
        return item


@dataclass(eq=False)
class Entry:
    """A queued or running request (the stock queue ``Entry``)."""

    request: ValidRequest
    channel: ResponseChannel
    queue_time: float
    batch_time: float | None = None
    block_allocation: BlockAllocation | None = None
    tokens_received: int = 0
    prefill_received: bool = False

    def drop(self) -> None:
        """What dropping the stock entry does: free its blocks, end its response stream."""
        if self.block_allocation is not None:
            self.block_allocation.free()
        self.channel.drop_sender()
