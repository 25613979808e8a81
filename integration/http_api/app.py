"""The app factory: TGI's HTTP routes (``router/src/server.rs``) over a router replay.

``create_app(router, ApiConfig(model_id=...))`` returns a Starlette ASGI app; serve it with uvicorn
(see :mod:`integration.http_api.serving`). Routes:

========================  ====  ==================================================================
``/``                     POST  compat: JSON **array** of one response, or SSE with ``stream: true``
``/generate``             POST  one response object
``/generate_stream``      POST  SSE (always 200; errors are events)
``/v1/chat/completions``  POST  OpenAI chat (stream or not)
``/v1/completions``       POST  OpenAI completions (stream or not)
``/``, ``/health``, ``/ping``  GET  ``router.health()``: 200 empty, or 503 ``healthcheck``
``/info``                 GET   the stock ``Info`` object
``/metrics``              GET   Prometheus text (stock series names)
``/v1/models``            GET   one model
========================  ====  ==================================================================

Replay-only behaviour: when the router replay has recorded a fatal shard mistake (the stock batching
task would have panicked and wedged silently), requests and ``/health`` answer 500 with
``error_type: router_fatal`` instead of hanging.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .chat import chat_completions, completions
from .generation import ApiConfig, ApiContext, generate, until_disconnect
from .metrics import CONTENT_TYPE, HttpMetrics
from .schemas import (
    ApiError,
    BodyError,
    ChatRequest,
    CompatGenerateRequest,
    CompletionRequest,
    GenerateRequest,
    api_error,
    parse_body,
)
from .streaming import generate_stream_response
from .tools import tokenizer_chat_template

_AUTO = object()


def create_app(router: Any, config: ApiConfig, *, chat_template: Any = _AUTO) -> Starlette:
    """TGI's HTTP API over ``router`` (a connected ``integration.router_replay.Router``).

    ``chat_template``: a callable ``(messages, tools=None) -> prompt`` with an optional ``uses_tools``
    attribute (whether the template reads ``tools``; see :mod:`.tools`); by default the router
    tokenizer's ``apply_chat_template`` (requests get a 422 ``template_error`` when it has none).
    """
    if chat_template is _AUTO:
        chat_template = tokenizer_chat_template(router.tokenizer)
    metrics = HttpMetrics(
        router, max_input_tokens=router.info.max_input_tokens, max_total_tokens=router.info.max_total_tokens
    )
    ctx = ApiContext(router=router, config=config, metrics=metrics, chat_template=chat_template)

    def post(model: type, handler: Callable[[Request, Any, float], Awaitable[Response]]):
        async def endpoint(request: Request) -> Response:
            start = time.monotonic()
            try:
                body = parse_body(await request.body(), request.headers.get("content-type"), model)
                return await handler(request, body, start)
            except BodyError as err:
                return PlainTextResponse(err.message, status_code=err.status)
            except ApiError as err:
                return JSONResponse(err.body(), status_code=err.status)

        return endpoint

    async def compat(request: Request, req: CompatGenerateRequest, start: float) -> Response:
        if req.parameters.return_full_text is None:
            req.parameters.return_full_text = config.default_return_full_text
        if req.stream:
            return generate_stream_response(ctx, req, start)
        result = await until_disconnect(request, generate(ctx, req, start=start))
        return JSONResponse([result.body], headers=result.headers)

    async def generate_route(request: Request, req: GenerateRequest, start: float) -> Response:
        result = await until_disconnect(request, generate(ctx, req, start=start))
        return JSONResponse(result.body, headers=result.headers)

    async def generate_stream_route(request: Request, req: GenerateRequest, start: float) -> Response:
        return generate_stream_response(ctx, req, start)

    async def chat_route(request: Request, req: ChatRequest, start: float) -> Response:
        if req.stream:
            return await chat_completions(ctx, req, start)
        body, headers = await until_disconnect(request, chat_completions(ctx, req, start))
        return JSONResponse(body, headers=headers)

    async def completions_route(request: Request, req: CompletionRequest, start: float) -> Response:
        if req.stream:
            return await completions(ctx, req, start)
        body, headers = await until_disconnect(request, completions(ctx, req, start))
        return JSONResponse(body, headers=headers)

    async def health(request: Request) -> Response:
        try:
            healthy = await router.health()
        except Exception as err:  # noqa: BLE001 - mapped (or re-raised) by api_error
            mapped = api_error(err)
            return JSONResponse(mapped.body(), status_code=mapped.status)
        if healthy:
            return Response(status_code=200)
        return JSONResponse({"error": "unhealthy", "error_type": "healthcheck"}, status_code=503)

    async def info(request: Request) -> Response:
        return JSONResponse(info_json(router, config))

    async def models(request: Request) -> Response:
        model = {"id": config.model_id, "object": "model", "created": 0, "owned_by": config.model_id}
        return JSONResponse({"object": "list", "data": [model]})

    async def metrics_route(request: Request) -> Response:
        return PlainTextResponse(metrics.render(), headers={"content-type": CONTENT_TYPE})

    routes = [
        Route("/", post(CompatGenerateRequest, compat), methods=["POST"]),
        Route("/generate", post(GenerateRequest, generate_route), methods=["POST"]),
        Route("/generate_stream", post(GenerateRequest, generate_stream_route), methods=["POST"]),
        Route("/v1/chat/completions", post(ChatRequest, chat_route), methods=["POST"]),
        Route("/v1/completions", post(CompletionRequest, completions_route), methods=["POST"]),
        Route("/", health, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET"]),
        Route("/info", info, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.context = ctx
    return app


def info_json(router: Any, config: ApiConfig) -> dict[str, Any]:
    """The stock ``/info`` object (``max_batch_total_tokens``, dtype and device are not exposed)."""
    info = router.info
    return {
        "model_id": config.model_id,
        "model_sha": config.model_sha,
        "model_pipeline_tag": config.model_pipeline_tag,
        "max_concurrent_requests": info.max_concurrent_requests,
        "max_best_of": config.max_best_of,
        "max_stop_sequences": config.max_stop_sequences,
        "max_input_tokens": info.max_input_tokens,
        "max_total_tokens": info.max_total_tokens,
        "validation_workers": config.validation_workers,
        "max_client_batch_size": config.max_client_batch_size,
        "router": config.router_name,
        "version": config.version,
        "sha": None,
        "docker_label": config.docker_label,
    }
