"""OpenAI-style routes: ``/v1/chat/completions`` and ``/v1/completions`` (stock ``server.rs`` shapes).

Chat prompts are rendered with the model's own chat template (:func:`.tools.tokenizer_chat_template`)
and sent with ``add_special_tokens=False`` (the template already has BOS). As in the stock router,
message contents are flattened to text (image chunks become ``![](url)``, tool-call messages the
stock JSON of their calls), and a trailing assistant message is continued: the rendering is cut
right after that message's text.

``response_format`` is the stock ``GrammarType`` (``json``/``json_object``, ``json_schema``,
``regex``), compiled by the router replay like a ``/generate`` grammar; it and ``tools`` are mutually
exclusive (``Tool error: Grammar and tools are mutually exclusive``). ``tools`` become a grammar and
a tool prompt (:mod:`.tools`); the answer becomes ``tool_calls``, or, when the model picks
``no_tool``, a second answer to the same messages without tools (:mod:`.tool_calls`). As stock, that
second answer's text and ``prompt_tokens`` are returned with the first answer's ``finish_reason``,
``completion_tokens`` and logprobs.

Byte-level difference from the stock router: the stream terminator is ``data: [DONE]`` (with a
space), not axum's ``data:[DONE]``. Both are the same SSE event, but ``huggingface_hub``'s parser only
recognises the spaced form and crashes on the other (huggingface_hub #4536). Everything else keeps the
axum framing (``data:{json}``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from integration.router_replay import Token

from .generation import ApiContext, Collected, counted, f32, generate
from .schemas import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    Parameters,
    tool_error,
)
from .streaming import SSEResponse, dumps, sse, stream_events, with_keepalive
from .tool_calls import NO_TOOL, ToolCallStream, next_tool_call_id, parse_output, tool_delta
from .tools import chosen_tools, render_chat, tool_grammar

DONE = b"data: [DONE]\n\n"


def _now() -> int:
    return int(time.time())


def _sampling(temperature: float | None) -> tuple[bool, float | None]:
    """``temperature == 0`` means greedy (and no temperature), anything else samples."""
    if temperature == 0.0:
        return False, None
    return True, temperature


def _adapter(model: str | None) -> str | None:
    return None if model in (None, "tgi") else model


def chat_to_generate(
    ctx: ApiContext, chat: ChatRequest, *, without_tools: bool = False
) -> tuple[GenerateRequest, bool]:
    """The stock ``try_into_generate``: the generate request and whether it uses tools.

    ``without_tools``: the ``no_tool`` retry (``tools`` and ``response_format`` dropped).
    """
    tools = None if without_tools else chat.tools
    grammar = None if without_tools else chat.response_format
    if grammar is not None and tools is not None:
        raise tool_error("Grammar and tools are mutually exclusive")
    offered = chosen_tools(tools, chat.tool_choice) if grammar is None and tools is not None else None
    if offered is not None:
        grammar = tool_grammar(offered)
    inputs = render_chat(ctx.chat_template, chat.messages, offered, chat.tool_prompt)
    do_sample, temperature = _sampling(chat.temperature)
    params = Parameters(
        temperature=temperature,
        repetition_penalty=None if chat.presence_penalty is None else chat.presence_penalty + 2.0,
        frequency_penalty=chat.frequency_penalty,
        top_p=chat.top_p,
        do_sample=do_sample,
        max_new_tokens=chat.max_tokens,
        stop=list(chat.stop or []),
        details=True,
        seed=chat.seed,
        top_n_tokens=chat.top_logprobs,
        grammar=grammar,
        adapter_id=_adapter(chat.model),
    )
    return GenerateRequest(inputs=inputs, parameters=params), offered is not None


def _logprobs(tokens: list[Token], top_tokens: list[tuple[Token, ...]]) -> dict[str, Any]:
    """The stock ``ChatCompletionLogprobs`` of a finished request (top tokens per position)."""
    content = []
    for i, token in enumerate(tokens):
        tops = top_tokens[i] if i < len(top_tokens) else ()
        content.append(
            {
                "token": token.text,
                "logprob": f32(token.logprob),
                "top_logprobs": [{"token": t.text, "logprob": f32(t.logprob)} for t in tops],
            }
        )
    return {"content": content}


def _finish(reason: str) -> str:
    return "stop" if reason == "eos_token" else reason


async def chat_completions(
    ctx: ApiContext, chat: ChatRequest, start: float
) -> tuple[dict[str, Any], dict] | SSEResponse:
    """Non-stream: ``(body, headers)``; stream: an :class:`SSEResponse`. Raises :class:`ApiError`."""
    ctx.metrics.request()
    try:
        req, using_tools = chat_to_generate(ctx, chat)
    except ApiError as err:
        raise counted(ctx, err) from None
    model = ctx.config.model_id if chat.model in (None, "tgi") else chat.model
    fingerprint = ctx.config.system_fingerprint
    if chat.stream:
        include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
        body = _chat_chunks(ctx, chat, req, using_tools, model, bool(chat.logprobs), include_usage, start)
        headers = {"x-compute-type": ctx.config.compute_type, "x-compute-characters": str(len(req.inputs))}
        return SSEResponse(with_keepalive(body, ctx.config.keep_alive_s), headers)
    result = await generate(ctx, req, add_special_tokens=False, start=start)
    c: Collected = result.collected
    final, headers, prompt_tokens = c.final, result.headers, c.final.input_length
    message: dict[str, Any] = {"role": "assistant", "content": result.body["generated_text"]}
    if using_tools:
        tool_calls = parse_output(result.body["generated_text"])
        if tool_calls is not None:
            message = {"role": "assistant", "tool_calls": tool_calls}
        else:  # no_tool: answer again without tools; stock keeps the first answer's details
            retry, _ = chat_to_generate(ctx, chat, without_tools=True)
            again = await generate(ctx, retry, add_special_tokens=False)
            message["content"] = again.body["generated_text"]
            headers, prompt_tokens = again.headers, again.collected.final.input_length
    body = {
        "object": "chat.completion",
        "id": "",
        "created": _now(),
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _logprobs(c.tokens, c.top_tokens) if chat.logprobs else None,
                "finish_reason": _finish(final.finish_reason),
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": final.generated_tokens,
            "total_tokens": prompt_tokens + final.generated_tokens,
        },
    }
    return body, headers


def _openai_error(item: dict[str, Any]) -> bytes:
    return sse({"error": {"message": item["error"], "http_status_code": 422}})


def _token_logprobs(text: str, token: dict[str, Any], top: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": text,
                "logprob": token["logprob"],
                "top_logprobs": [{"token": t["text"], "logprob": t["logprob"]} for t in top],
            }
        ]
    }


async def _chat_chunks(
    ctx: ApiContext,
    chat: ChatRequest,
    req: GenerateRequest,
    using_tools: bool,
    model: str,
    logprobs: bool,
    include_usage: bool,
    start: float,
) -> AsyncIterator[bytes]:
    fingerprint = ctx.config.system_fingerprint
    call_id = next_tool_call_id(chat.messages)
    tools = ToolCallStream() if using_tools else None
    events = stream_events(ctx, req, add_special_tokens=False, start=start)

    def chunk(delta: dict[str, Any], text: str, item: dict[str, Any], details: dict[str, Any] | None) -> bytes:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": _token_logprobs(text, item["token"], item.get("top_tokens", [])) if logprobs else None,
            "finish_reason": _finish(details["finish_reason"]) if details else None,
        }
        return sse(
            {
                "object": "chat.completion.chunk",
                "id": "",
                "created": _now(),
                "model": model,
                "system_fingerprint": fingerprint,
                "choices": [choice],
                "usage": None,
            }
        )

    try:
        while True:
            retry = False
            async for item in events:
                if "error" in item:
                    yield _openai_error(item)
                    break
                token, details = item["token"], item.get("details")
                if tools is None:
                    content = "" if token["special"] else token["text"]
                    yield chunk({"role": "assistant", "content": content}, token["text"], item, details)
                else:
                    out = tools.push(token["text"])
                    if out is NO_TOOL:
                        retry = True
                        break
                    if out is not None:
                        text, name = out
                        yield chunk(tool_delta(call_id, text, name, token["special"]), text, item, details)
                if include_usage and details:
                    usage = {
                        "prompt_tokens": details["input_length"],
                        "completion_tokens": details["generated_tokens"],
                        "total_tokens": details["input_length"] + details["generated_tokens"],
                    }
                    yield sse(
                        {
                            "object": "chat.completion.chunk",
                            "id": "",
                            "created": _now(),
                            "model": model,
                            "system_fingerprint": fingerprint,
                            "choices": [],
                            "usage": usage,
                        }
                    )
            if not retry:
                break
            await events.aclose()  # the router drops the tool request
            retry_req, _ = chat_to_generate(ctx, chat, without_tools=True)
            tools, events = None, stream_events(ctx, retry_req, add_special_tokens=False)
    finally:
        await events.aclose()
    yield DONE


# -- /v1/completions --------------------------------------------------------------------------------


def _completion_requests(ctx: ApiContext, req: CompletionRequest) -> list[GenerateRequest]:
    if req.suffix is not None:
        raise ApiError(
            422,
            "Suffix is not supported and can be achieved by preprocessing the prompt.",
            "suffix not supported",
            "validation",
        )
    prompts = req.prompts()
    if len(prompts) > ctx.config.max_client_batch_size:
        raise ApiError(
            422,
            f"Number of prompts exceeds the maximum allowed batch size of {ctx.config.max_client_batch_size}",
            "batch size exceeded",
            "validation",
        )
    do_sample, temperature = _sampling(req.temperature)
    return [
        GenerateRequest(
            inputs=prompt,
            parameters=Parameters(
                temperature=temperature,
                repetition_penalty=req.repetition_penalty,
                frequency_penalty=req.frequency_penalty,
                top_p=req.top_p,
                do_sample=do_sample,
                max_new_tokens=req.max_tokens,
                stop=list(req.stop or []),
                details=True,
                decoder_input_details=not req.stream,
                seed=req.seed,
                adapter_id=_adapter(req.model),
            ),
        )
        for prompt in prompts
    ]


async def completions(
    ctx: ApiContext, req: CompletionRequest, start: float
) -> tuple[dict[str, Any], dict] | SSEResponse:
    ctx.metrics.request()
    try:
        requests = _completion_requests(ctx, req)
    except ApiError as err:
        raise counted(ctx, err) from None
    fingerprint, model = ctx.config.system_fingerprint, ctx.config.model_id
    if req.stream:
        headers = {
            "x-compute-type": ctx.config.compute_type,
            "x-compute-characters": str(sum(len(r.inputs) for r in requests)),
        }
        return SSEResponse(with_keepalive(_completion_chunks(ctx, requests, start), ctx.config.keep_alive_s), headers)
    results = await asyncio.gather(*(generate(ctx, r, start=start) for r in requests))
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for index, result in enumerate(results):
        final = result.collected.final
        prompt_tokens += final.input_length
        completion_tokens += final.generated_tokens
        choices.append(
            {
                "index": index,
                "text": result.body["generated_text"],
                "logprobs": None,
                "finish_reason": _finish(final.finish_reason),
            }
        )
    body = {
        "object": "text_completion",
        "id": "",
        "created": _now(),
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    headers = dict(results[0].headers) if results else {}
    return body, headers


async def _completion_chunks(ctx: ApiContext, requests: list[GenerateRequest], start: float) -> AsyncIterator[bytes]:
    """Each prompt streams on its own; chunks are interleaved as they come, then ``[DONE]``."""
    fingerprint, model = ctx.config.system_fingerprint, ctx.config.model_id
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def run(index: int, req: GenerateRequest) -> None:
        try:
            async for item in stream_events(ctx, req, start=start):
                if "error" in item:
                    await queue.put(_openai_error(item))
                    return
                details = item.get("details")
                text = item["token"]["text"]
                if details:
                    usage = {
                        "prompt_tokens": details["input_length"],
                        "completion_tokens": details["generated_tokens"],
                        "total_tokens": details["input_length"] + details["generated_tokens"],
                    }
                    event = {
                        "object": "text_completion",
                        "id": "",
                        "created": _now(),
                        "model": model,
                        "system_fingerprint": fingerprint,
                        "choices": [
                            {"index": index, "text": text, "logprobs": None, "finish_reason": details["finish_reason"]}
                        ],
                        "usage": usage,
                    }
                else:
                    event = {
                        "object": "text_completion",
                        "id": "",
                        "created": _now(),
                        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": ""}],
                        "model": model,
                        "system_fingerprint": fingerprint,
                    }
                await queue.put(f"data:{dumps(event)}\n\n".encode())
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(run(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            chunk = await queue.get()
            if chunk is None:
                remaining -= 1
            else:
                yield chunk
        yield DONE
    finally:
        for task in tasks:
            task.cancel()
