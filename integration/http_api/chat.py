"""OpenAI-style routes: ``/v1/chat/completions`` and ``/v1/completions`` (stock ``server.rs`` shapes).

Chat prompts are rendered with the model's own chat template through
``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` and sent with
``add_special_tokens=False`` (the template already has BOS). As in the stock router, message contents
are flattened to text (image chunks become ``![](url)``), and a trailing assistant message is
continued: the rendering is cut right after that message's text.

Byte-level difference from the stock router: the stream terminator is ``data: [DONE]`` (with a
space), not axum's ``data:[DONE]``. Both are the same SSE event, but ``huggingface_hub``'s parser only
recognises the spaced form and crashes on the other (huggingface_hub #4536). Everything else keeps the
axum framing (``data:{json}``).

Not replayed (answered with a 422): ``tools`` (``tool_error``) and JSON-schema ``response_format``
(the stock router compiles schemas to regexes with outlines-core).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from integration.router_replay import Token

from .generation import ApiContext, Collected, counted, f32, generate
from .schemas import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    Parameters,
    template_error,
    tool_error,
)
from .streaming import SSEResponse, dumps, sse, stream_events, with_keepalive

DONE = b"data: [DONE]\n\n"


def tokenizer_chat_template(tokenizer: Any) -> Callable[[list[dict[str, str]]], str]:
    """A renderer over ``tokenizer.apply_chat_template``; raises ``template_error`` when it has none."""

    def render(messages: list[dict[str, str]]) -> str:
        if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
            raise template_error("template not found")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001 - jinja errors, raise_exception() in templates
            raise template_error(str(err)) from None
        if messages and messages[-1]["role"] == "assistant":
            content = messages[-1]["content"]
            cut = text.rfind(content)
            if cut >= 0:
                text = text[: cut + len(content)].rstrip()
        return text

    return render


def _now() -> int:
    return int(time.time())


def _sampling(temperature: float | None) -> tuple[bool, float | None]:
    """``temperature == 0`` means greedy (and no temperature), anything else samples."""
    if temperature == 0.0:
        return False, None
    return True, temperature


def _adapter(model: str | None) -> str | None:
    return None if model in (None, "tgi") else model


def chat_to_generate(ctx: ApiContext, chat: ChatRequest) -> GenerateRequest:
    if chat.response_format is not None and chat.tools is not None:
        raise tool_error("Grammar and tools are mutually exclusive")
    if chat.tools is not None:
        raise tool_error("tools are not supported by this HTTP stand-in (the stock router's tool grammar "
                         "is not replayed)")
    if ctx.chat_template is None:
        raise template_error("template not found")
    messages = [{"role": m.role, "content": m.text()} for m in chat.messages]
    inputs = ctx.chat_template(messages)
    do_sample, temperature = _sampling(chat.temperature)
    params = Parameters(
        temperature=temperature,
        repetition_penalty=None if chat.presence_penalty is None else chat.presence_penalty + 2.0,
        frequency_penalty=chat.frequency_penalty, top_p=chat.top_p, do_sample=do_sample,
        max_new_tokens=chat.max_tokens, stop=list(chat.stop or []), details=True, seed=chat.seed,
        top_n_tokens=chat.top_logprobs, grammar=chat.response_format, adapter_id=_adapter(chat.model),
    )
    return GenerateRequest(inputs=inputs, parameters=params)


def _logprobs(tokens: list[Token], top_tokens: list[tuple[Token, ...]]) -> dict[str, Any]:
    """The stock ``ChatCompletionLogprobs`` of a finished request (top tokens per position)."""
    content = []
    for i, token in enumerate(tokens):
        tops = top_tokens[i] if i < len(top_tokens) else ()
        content.append({"token": token.text, "logprob": f32(token.logprob),
                        "top_logprobs": [{"token": t.text, "logprob": f32(t.logprob)} for t in tops]})
    return {"content": content}


def _finish(reason: str) -> str:
    return "stop" if reason == "eos_token" else reason


async def chat_completions(ctx: ApiContext, chat: ChatRequest,
                           start: float) -> tuple[dict[str, Any], dict] | SSEResponse:
    """Non-stream: ``(body, headers)``; stream: an :class:`SSEResponse`. Raises :class:`ApiError`."""
    ctx.metrics.request()
    try:
        req = chat_to_generate(ctx, chat)
    except ApiError as err:
        raise counted(ctx, err) from None
    model = ctx.config.model_id if chat.model in (None, "tgi") else chat.model
    fingerprint = ctx.config.system_fingerprint
    if chat.stream:
        include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
        body = _chat_chunks(ctx, req, model, bool(chat.logprobs), include_usage, start)
        headers = {"x-compute-type": ctx.config.compute_type, "x-compute-characters": str(len(req.inputs))}
        return SSEResponse(with_keepalive(body, ctx.config.keep_alive_s), headers)
    result = await generate(ctx, req, add_special_tokens=False, start=start)
    c: Collected = result.collected
    final = c.final
    body = {
        "object": "chat.completion", "id": "", "created": _now(), "model": model, "system_fingerprint": fingerprint,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.body["generated_text"]},
                     "logprobs": _logprobs(c.tokens, c.top_tokens) if chat.logprobs else None,
                     "finish_reason": _finish(final.finish_reason)}],
        "usage": {"prompt_tokens": final.input_length, "completion_tokens": final.generated_tokens,
                  "total_tokens": final.input_length + final.generated_tokens},
    }
    return body, result.headers


def _openai_error(item: dict[str, Any]) -> bytes:
    return sse({"error": {"message": item["error"], "http_status_code": 422}})


async def _chat_chunks(ctx: ApiContext, req: GenerateRequest, model: str, logprobs: bool, include_usage: bool,
                       start: float) -> AsyncIterator[bytes]:
    fingerprint = ctx.config.system_fingerprint
    async for item in stream_events(ctx, req, add_special_tokens=False, start=start):
        if "error" in item:
            yield _openai_error(item)
            break
        token = item["token"]
        details = item.get("details")
        top = item.get("top_tokens", [])
        choice = {"index": 0, "delta": {"role": "assistant", "content": "" if token["special"] else token["text"]},
                  "logprobs": ({"content": [{"token": token["text"], "logprob": token["logprob"],
                                             "top_logprobs": [{"token": t["text"], "logprob": t["logprob"]}
                                                              for t in top]}]} if logprobs else None),
                  "finish_reason": _finish(details["finish_reason"]) if details else None}
        yield sse({"object": "chat.completion.chunk", "id": "", "created": _now(), "model": model,
                   "system_fingerprint": fingerprint, "choices": [choice], "usage": None})
        if include_usage and details:
            usage = {"prompt_tokens": details["input_length"], "completion_tokens": details["generated_tokens"],
                     "total_tokens": details["input_length"] + details["generated_tokens"]}
            yield sse({"object": "chat.completion.chunk", "id": "", "created": _now(), "model": model,
                       "system_fingerprint": fingerprint, "choices": [], "usage": usage})
    yield DONE


# -- /v1/completions --------------------------------------------------------------------------------


def _completion_requests(ctx: ApiContext, req: CompletionRequest) -> list[GenerateRequest]:
    if req.suffix is not None:
        raise ApiError(422, "Suffix is not supported and can be achieved by preprocessing the prompt.",
                       "suffix not supported", "validation")
    prompts = req.prompts()
    if len(prompts) > ctx.config.max_client_batch_size:
        raise ApiError(422, "Number of prompts exceeds the maximum allowed batch size of "
                            f"{ctx.config.max_client_batch_size}", "batch size exceeded", "validation")
    do_sample, temperature = _sampling(req.temperature)
    return [GenerateRequest(inputs=prompt, parameters=Parameters(
        temperature=temperature, repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty, top_p=req.top_p, do_sample=do_sample,
        max_new_tokens=req.max_tokens, stop=list(req.stop or []), details=True,
        decoder_input_details=not req.stream, seed=req.seed, adapter_id=_adapter(req.model)))
        for prompt in prompts]


async def completions(ctx: ApiContext, req: CompletionRequest,
                      start: float) -> tuple[dict[str, Any], dict] | SSEResponse:
    ctx.metrics.request()
    try:
        requests = _completion_requests(ctx, req)
    except ApiError as err:
        raise counted(ctx, err) from None
    fingerprint, model = ctx.config.system_fingerprint, ctx.config.model_id
    if req.stream:
        headers = {"x-compute-type": ctx.config.compute_type,
                   "x-compute-characters": str(sum(len(r.inputs) for r in requests))}
        return SSEResponse(with_keepalive(_completion_chunks(ctx, requests, start), ctx.config.keep_alive_s), headers)
    results = await asyncio.gather(*(generate(ctx, r, start=start) for r in requests))
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for index, result in enumerate(results):
        final = result.collected.final
        prompt_tokens += final.input_length
        completion_tokens += final.generated_tokens
        choices.append({"index": index, "text": result.body["generated_text"], "logprobs": None,
                        "finish_reason": _finish(final.finish_reason)})
    body = {"object": "text_completion", "id": "", "created": _now(), "model": model,
            "system_fingerprint": fingerprint, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
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
                    usage = {"prompt_tokens": details["input_length"], "completion_tokens": details["generated_tokens"],
                             "total_tokens": details["input_length"] + details["generated_tokens"]}
                    event = {"object": "text_completion", "id": "", "created": _now(), "model": model,
                             "system_fingerprint": fingerprint,
                             "choices": [{"index": index, "text": text, "logprobs": None,
                                          "finish_reason": details["finish_reason"]}], "usage": usage}
                else:
                    event = {"object": "text_completion", "id": "", "created": _now(),
                             "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": ""}],
                             "model": model, "system_fingerprint": fingerprint}
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
