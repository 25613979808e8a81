"""One client request's event stream, including the stock router's continuation legs.

The stock ``Infer`` layer wraps each request's channel: it counts tokens, and when a leg ends with
``length`` before the client's total ``max_new_tokens`` (legs are capped at 1024), it appends the
leg's text to the prompt, re-validates with the same seed and schedules a **new** request (new id,
new blocks, new prefill); the leg's last token is then re-emitted as an intermediate token. If
re-validation fails (e.g. the prompt grew too long) the accumulated result is returned. The final
``generated_tokens`` is the router's own running count.

Dropping the stream (``aclose()``, or losing the last reference) is a client disconnect: the batching
loop notices it at the request's next Generation and filters it out of the shard's batch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .datatypes import (
    End,
    Failure,
    FinalEvent,
    GeneratedText,
    GenerateParameters,
    Intermediate,
    PrefillEvent,
    PrefillToken,
    ResponseChannel,
    StreamEvent,
    TokenEvent,
    ValidRequest,
)
from .errors import GenerationError, IncompleteGenerationError, ValidationError

if TYPE_CHECKING:
    from .router import Router


class GenerationStream:
    """Async iterator of ``PrefillEvent`` (only if the shard sent prefill tokens), ``TokenEvent``s
    and one closing ``FinalEvent``. Errors surface as exceptions from ``__anext__``."""

    def __init__(
        self,
        router: Router,
        inputs: str,
        params: GenerateParameters,
        valid: ValidRequest,
        request_id: int,
        channel: ResponseChannel,
    ) -> None:
        self._router = router
        self._inputs = inputs
        self._params = dataclasses.replace(params, seed=valid.seed)
        self._channel = channel
        self._max_total_new_tokens = valid.max_total_new_tokens
        self.input_length = valid.input_length
        self.request_ids = [request_id]
        """Router request ids of every leg, in order (the first is the original request)."""
        self._total = 0
        self._accumulated: GeneratedText | None = None
        self._first_start: float | None = None
        self._first_queued: float | None = None
        self._prefill: tuple[PrefillToken, ...] = ()
        self._done = False
        self._permit = True

    def __aiter__(self) -> GenerationStream:
        return self

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _release(self) -> None:
        if self._permit:
            self._permit = False
            self._router._release_permit()

    def _finish(self) -> None:
        self._done = True
        self._channel.close()
        self._release()

    async def aclose(self) -> None:
        """Client disconnect."""
        if not self._done:
            self._finish()
        self._release()

    def __del__(self) -> None:
        try:
            if not self._done:
                self._finish()
            self._release()
        except Exception:
            pass

    async def collect(self) -> list[StreamEvent]:
        """Every event up to and including the ``FinalEvent``."""
        return [event async for event in self]

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        item = await self._channel.recv()
        if item is None:
            self._finish()
            raise IncompleteGenerationError()
        if isinstance(item, Failure):
            self._finish()
            if isinstance(item.error, GenerationError):
                self._router._backend_healthy = False
            raise item.error
        if isinstance(item, PrefillEvent):
            self._prefill = item.tokens
            return item
        if isinstance(item, Intermediate):
            self._total += 1
            return TokenEvent(item.token.id, item.token.text, item.token.logprob, item.token.special, item.top_tokens)
        assert isinstance(item, End)
        return await self._on_end(item)

    async def _on_end(self, item: End) -> TokenEvent:
        self._total += 1
        if self._first_start is None:
            self._first_start, self._first_queued = item.start, item.queued
        leg = item.generated_text
        if self._accumulated is not None:
            self._accumulated = dataclasses.replace(
                self._accumulated,
                text=self._accumulated.text + leg.text,
                generated_tokens=self._total,
                finish_reason=leg.finish_reason,
            )
        if leg.finish_reason == "length" and self._total < self._max_total_new_tokens:
            self._inputs += leg.text
            if self._accumulated is None:
                self._accumulated = leg
            try:
                valid = await self._router._validator.validate(self._inputs, self._params)
            except ValidationError:
                return self._final(item, self._accumulated)
            request_id, self._channel = self._router._schedule(valid, continuation=True)
            self.request_ids.append(request_id)
            token = item.token
            return TokenEvent(token.id, token.text, token.logprob, token.special, item.top_tokens)
        return self._final(item, self._accumulated or leg)

    def _final(self, item: End, result: GeneratedText) -> FinalEvent:
        self._done = True
        self._channel.close()
        self._release()
        token = item.token
        assert self._first_queued is not None and self._first_start is not None
        return FinalEvent(
            id=token.id,
            text=token.text,
            logprob=token.logprob,
            special=token.special,
            top_tokens=item.top_tokens,
            generated_text=result.text,
            finish_reason=result.finish_reason,
            generated_tokens=result.generated_tokens,
            seed=result.seed,
            prefill=self._prefill,
            input_length=self.input_length,
            queued=self._first_queued,
            start=self._first_start,
        )
