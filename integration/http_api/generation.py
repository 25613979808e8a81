"""Non-streaming generation: ``/generate``, ``POST /`` without ``stream``, and the pieces every route
shares (the API context, token JSON, error accounting, client-disconnect handling).

JSON numbers: the stock router serialises logprobs as ``f32`` (shortest ``f32`` digits, ``NaN`` as
``null``); :func:`f32` reproduces those digits so ``-4.186315`` is not sent as ``-4.186315059661865``.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from integration.router_replay import (
    FinalEvent,
    GenerateParameters,
    GenerationStream,
    IncompleteGenerationError,
    PrefillEvent,
    PrefillToken,
    Token,
)

from .metrics import HttpMetrics
from .schemas import ApiError, GenerateRequest, api_error, check_best_of, router_parameters

DISCONNECT_POLL_S = 0.5
"""How often a non-streaming handler checks whether its client went away."""


@dataclass
class ApiConfig:
    """What the stock router knows from its command line and the hub (defaults: the stock defaults)."""

    model_id: str
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_client_batch_size: int = 4
    validation_workers: int = 2
    version: str = "3.3.6-dev0"
    router_name: str = "text-generation-router"
    model_sha: str | None = None
    model_pipeline_tag: str | None = None
    docker_label: str | None = None
    compute_type: str = field(default_factory=lambda: os.environ.get("COMPUTE_TYPE", "gpu+optimized"))
    keep_alive_s: float = 15.0
    """SSE keep-alive comment interval (axum's default)."""

    @property
    def default_return_full_text(self) -> bool:
        """``POST /`` only: stock defaults ``return_full_text`` to true for ``text-generation`` or unknown."""
        return self.model_pipeline_tag in (None, "text-generation")

    @property
    def system_fingerprint(self) -> str:
        return f"{self.version}-{self.docker_label or 'native'}"


@dataclass
class ApiContext:
    router: Any
    """An ``integration.router_replay.Router`` (anything with ``generate``, ``health``, ``info``, ``stats``)."""
    config: ApiConfig
    metrics: HttpMetrics
    chat_template: Callable[..., str] | None = None
    """``render(messages, tools=None) -> prompt`` (see :func:`.tools.tokenizer_chat_template`)."""


def f32(value: float) -> float | None:
    """A logprob as the stock router serialises it: ``f32`` digits, ``NaN`` as ``null``."""
    if value is None or math.isnan(value):
        return None
    return float(str(np.float32(value)))


def token_json(token: Token) -> dict[str, Any]:
    return {"id": token.id, "text": token.text, "logprob": f32(token.logprob), "special": token.special}


def prefill_json(token: PrefillToken) -> dict[str, Any]:
    return {"id": token.id, "text": token.text, "logprob": f32(token.logprob)}


async def open_stream(ctx: ApiContext, inputs: str, params: GenerateParameters) -> GenerationStream:
    """``router.generate`` with the stock failure accounting; raises :class:`ApiError`."""
    try:
        return await ctx.router.generate(inputs, params)
    except Exception as err:  # noqa: BLE001 - mapped (or re-raised) by api_error
        raise counted(ctx, api_error(err)) from None


def counted(ctx: ApiContext, err: ApiError) -> ApiError:
    if err.metric is not None:
        ctx.metrics.failure(err.metric)
    return err


@dataclass
class Collected:
    """One finished request, as the stock ``Infer::generate`` gathers it."""

    final: FinalEvent
    prefill: tuple[PrefillToken, ...]
    tokens: list[Token]
    top_tokens: list[tuple[Token, ...]]


async def collect(ctx: ApiContext, stream: GenerationStream) -> Collected:
    """Drain ``stream``; the stream is closed (a client disconnect for the router) however this ends."""
    prefill: tuple[PrefillToken, ...] = ()
    tokens: list[Token] = []
    top_tokens: list[tuple[Token, ...]] = []
    try:
        async for event in stream:
            if isinstance(event, PrefillEvent):
                prefill = event.tokens
                continue
            tokens.append(event.token)
            top_tokens.append(event.top_tokens)
            if isinstance(event, FinalEvent):
                return Collected(event, prefill, tokens, top_tokens)
        raise IncompleteGenerationError()
    except Exception as err:  # noqa: BLE001 - mapped (or re-raised) by api_error
        raise counted(ctx, api_error(err)) from None
    finally:
        await stream.aclose()


async def until_disconnect(request: Any, work: Awaitable[Any]) -> Any:
    """Run ``work``; cancel it if the HTTP client disconnects first (the stock handler is dropped)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if request is not None and await request.is_disconnected():
                raise ApiError(499, "client disconnected", "dropped")
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - the cancellation (or its error) is expected
                pass


def _mean_logprob(collected: Collected) -> float:
    values = np.array([t.logprob for t in collected.tokens], dtype=np.float32)
    return float(values.sum(dtype=np.float32) / np.float32(len(values))) if len(values) else float("-inf")


async def _best_of(ctx: ApiContext, inputs: str, params: GenerateParameters, n: int) -> list[Collected]:
    """``n`` concurrent requests (each with its own permit); the best (mean logprob) first."""

    async def one() -> Collected:
        return await collect(ctx, await open_stream(ctx, inputs, params))

    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    best = 0
    best_value = -math.inf
    for i, result in enumerate(results):
        value = _mean_logprob(result)
        if value > best_value:
            best, best_value = i, value
    return [results[best], *results[:best], *results[best + 1 :]]


def details_json(
    c: Collected, *, with_top_tokens: bool, prompt: str | None = None, best_of: list[Collected] | None = None
) -> dict[str, Any]:
    final = c.final
    out: dict[str, Any] = {
        "finish_reason": final.finish_reason,
        "generated_tokens": final.generated_tokens,
        "seed": final.seed,
        "prefill": [prefill_json(t) for t in c.prefill],
        "tokens": [token_json(t) for t in c.tokens],
    }
    if best_of is not None:
        out["best_of_sequences"] = [
            {
                "generated_text": (prompt or "") + o.final.generated_text,
                "finish_reason": o.final.finish_reason,
                "generated_tokens": o.final.generated_tokens,
                "seed": o.final.seed,
                "prefill": [prefill_json(t) for t in o.prefill],
                "tokens": [token_json(t) for t in o.tokens],
                **({"top_tokens": [[token_json(t) for t in tt] for tt in o.top_tokens]} if with_top_tokens else {}),
            }
            for o in best_of
        ]
    if with_top_tokens:
        out["top_tokens"] = [[token_json(t) for t in tt] for tt in c.top_tokens]
    return out


@dataclass
class GenerateResult:
    body: dict[str, Any]
    headers: dict[str, str]
    collected: Collected


async def generate(
    ctx: ApiContext, req: GenerateRequest, *, add_special_tokens: bool = True, start: float | None = None
) -> GenerateResult:
    """The stock ``generate_internal``: one request (or ``best_of``), details, headers and metrics."""
    start = time.monotonic() if start is None else start
    ctx.metrics.request()
    p = req.parameters
    try:
        n = check_best_of(p, ctx.config.max_best_of)
        params = router_parameters(p, add_special_tokens=add_special_tokens)
    except ApiError as err:
        raise counted(ctx, err) from None
    prompt = req.inputs if p.return_full_text else None
    others: list[Collected] | None = None
    if n > 1:
        best, *others = await _best_of(ctx, req.inputs, params, n)
    else:
        best = await collect(ctx, await open_stream(ctx, req.inputs, params))
    final = best.final
    body: dict[str, Any] = {"generated_text": (prompt or "") + final.generated_text}
    if p.details or p.decoder_input_details:
        body["details"] = details_json(best, with_top_tokens=bool(p.top_n_tokens), prompt=prompt, best_of=others)
    now = time.monotonic()
    headers = timing_headers(ctx, start=start, now=now, final=final, characters=len(req.inputs))
    record_success(ctx, final, start=start, now=now, max_new_tokens=p.max_new_tokens)
    return GenerateResult(body, headers, best)


def record_success(ctx: ApiContext, final: FinalEvent, *, start: float, now: float, max_new_tokens: int | None) -> None:
    """One request answered, into the stock router's request histograms: validation until the router queued
    it, queue until its first step, inference until ``now`` (streamed or not)."""
    ctx.metrics.success(
        total_s=now - start,
        validation_s=final.queued - start,
        queue_s=final.start - final.queued,
        inference_s=now - final.start,
        generated_tokens=final.generated_tokens,
        input_length=final.input_length,
        max_new_tokens=max_new_tokens,
    )


def timing_headers(ctx: ApiContext, *, start: float, now: float, final: FinalEvent, characters: int) -> dict[str, str]:
    total, inference = now - start, now - final.start
    per_token = inference / final.generated_tokens if final.generated_tokens else 0.0

    def ms(seconds: float) -> str:
        return str(int(max(seconds, 0.0) * 1000))

    return {
        "x-compute-type": ctx.config.compute_type,
        "x-compute-time": repr(total),
        "x-compute-characters": str(characters),
        "x-total-time": ms(total),
        "x-validation-time": ms(final.queued - start),
        "x-queue-time": ms(final.start - final.queued),
        "x-inference-time": ms(inference),
        "x-time-per-token": ms(per_token),
        "x-prompt-tokens": str(final.input_length),
        "x-generated-tokens": str(final.generated_tokens),
    }
