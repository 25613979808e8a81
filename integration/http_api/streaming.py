"""Server-sent events: ``/generate_stream`` and ``POST /`` with ``stream: true``.

Framing is axum 0.7's ``Sse``: ``data:`` with no space, compact JSON, a blank line; a ``:`` comment
every 15 s of silence as keep-alive. The response is always 200: validation and overload errors are
the first and only event (``{"error", "error_type"}``), a stream that ends without its final token
sends ``incomplete_generation_stream``. ``index`` counts every item the router delivered, prefill
items included (they are not sent), so it normally starts at 1.

A client that disconnects mid-stream closes the router stream (the router filters the request out of
the shard's batch at its next generation), see :class:`SSEResponse`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from integration.router_replay import FinalEvent, PrefillEvent

from .generation import ApiContext, counted, open_stream, record_success, token_json
from .schemas import ApiError, GenerateRequest, api_error, check_stream, router_parameters

KEEPALIVE = b":\n\n"
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}


def dumps(obj: Any) -> str:
    """Compact JSON like ``serde_json`` (no spaces, UTF-8 kept)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: Any) -> bytes:
    """One event, axum framing (``data:`` without a space)."""
    return f"data:{dumps(obj)}\n\n".encode()


class SSEResponse(StreamingResponse):
    """A streaming response whose body iterator is always closed when the response ends.

    Starlette leaves an interrupted async generator to the garbage collector; closing it here makes
    a client disconnect reach the router stream at once (its ``finally`` runs ``aclose``).
    """

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        super().__init__(content, status_code=200, headers={**SSE_HEADERS, **(headers or {})})
        self._source = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except OSError:
            pass  # the client went away while we were writing
        finally:
            aclose = getattr(self._source, "aclose", None)
            if aclose is not None:
                await aclose()


async def with_keepalive(source: AsyncIterator[bytes], interval_s: float) -> AsyncIterator[bytes]:
    """Yield ``source``'s chunks, and a keep-alive comment after each ``interval_s`` of silence."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump() -> None:
        try:
            async for chunk in source:
                await queue.put(chunk)
        except Exception as err:  # noqa: BLE001 - handed to the consumer
            await queue.put(_Raised(err))
        finally:
            await queue.put(done)

    task = asyncio.ensure_future(pump())
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), interval_s)
            except asyncio.TimeoutError:
                yield KEEPALIVE
                continue
            if item is done:
                return
            if isinstance(item, _Raised):
                raise item.err
            yield item
    finally:
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - cancellation expected
            pass
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


class _Raised:
    def __init__(self, err: BaseException) -> None:
        self.err = err


async def stream_events(
    ctx: ApiContext, req: GenerateRequest, *, add_special_tokens: bool = True, start: float | None = None
) -> AsyncIterator[dict[str, Any]]:
    """The stock ``generate_stream_internal``: ``StreamResponse`` dicts, or one error dict (then stop).

    Error dicts carry ``error``/``error_type``; callers frame them (TGI or OpenAI shape).
    """
    start = time.monotonic() if start is None else start
    ctx.metrics.request()
    p = req.parameters
    prompt = req.inputs if p.return_full_text else None
    try:
        check_stream(p)
        params = router_parameters(p, add_special_tokens=add_special_tokens)
    except ApiError as err:
        yield counted(ctx, err).body()
        return
    try:
        stream = await open_stream(ctx, req.inputs, params)
    except ApiError as err:
        yield err.body()
        return
    index = 0
    try:
        async for event in stream:
            index += 1
            if isinstance(event, PrefillEvent):
                continue
            item: dict[str, Any] = {"index": index, "token": token_json(event.token)}
            if event.top_tokens:
                item["top_tokens"] = [token_json(t) for t in event.top_tokens]
            if isinstance(event, FinalEvent):
                now = time.monotonic()
                record_success(ctx, event, start=start, now=now, max_new_tokens=p.max_new_tokens)
                item["generated_text"] = (prompt or "") + event.generated_text
                item["details"] = (
                    {
                        "finish_reason": event.finish_reason,
                        "generated_tokens": event.generated_tokens,
                        "seed": event.seed,
                        "input_length": event.input_length,
                    }
                    if p.details
                    else None
                )
                yield item
                return
            item["generated_text"] = None
            item["details"] = None
            yield item
    except Exception as err:  # noqa: BLE001 - mapped (or re-raised) by api_error
        mapped = api_error(err)
        if mapped.error_type == "incomplete_generation":
            mapped = ApiError(500, "Incomplete generation stream", "incomplete_generation_stream", "incomplete")
        yield counted(ctx, mapped).body()
        return
    finally:
        await stream.aclose()
    ctx.metrics.failure("incomplete")
    yield {"error": "Incomplete generation stream", "error_type": "incomplete_generation_stream"}


async def tgi_sse(ctx: ApiContext, req: GenerateRequest, start: float) -> AsyncIterator[bytes]:
    async for item in stream_events(ctx, req, start=start):
        yield sse(item)


def generate_stream_response(ctx: ApiContext, req: GenerateRequest, start: float) -> SSEResponse:
    headers = {"x-compute-type": ctx.config.compute_type, "x-compute-characters": str(len(req.inputs))}
    return SSEResponse(with_keepalive(tgi_sse(ctx, req, start), ctx.config.keep_alive_s), headers)
