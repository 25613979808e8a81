"""TGI's HTTP API (the stock router's ``router/src/server.rs`` surface) over the router replay.

The stock Rust router cannot run here; this stand-in puts its HTTP layer on top of
``integration.router_replay`` (which speaks ``generate.v3`` to the shards exactly like the stock
router), so the official clients -- ``text_generation.Client``/``AsyncClient`` and
``huggingface_hub.InferenceClient`` -- run unchanged against a real or fake shard. Written from the
behaviour in ``tgi-router-contract.md`` §3-§4; no TGI code copied.

Usage::

    from integration.http_api import HttpStack
    with HttpStack("/tmp/text-generation-server", "/models/smollm2") as stack:
        InferenceClient(base_url=stack.base_url).chat_completion(messages, model="tgi")

Modules: :mod:`.app` (factory, routes), :mod:`.schemas` (request bodies, TGI checks, error bodies),
:mod:`.generation` (non-streaming), :mod:`.streaming` (SSE), :mod:`.chat` (OpenAI routes),
:mod:`.tools` (tools -> grammar and tool prompt, chat template), :mod:`.tool_calls` (generated JSON ->
``tool_calls``), :mod:`.metrics` (``/metrics``), :mod:`.serving` (uvicorn, background loop). Grammars
(``json``, ``json_schema``, ``regex``) are validated and compiled to regexes by the router replay
(:mod:`integration.router_replay.grammar`, outlines-core as the stock router).

Byte-level differences from the stock router (all else aims at byte fidelity: ``data:`` framing
without a space, compact JSON, ``f32`` logprob digits, field order, status codes, messages):

* OpenAI streams (chat, completions) end with ``data: [DONE]`` (with a space): ``huggingface_hub``
  only recognises that form (it crashes on the stock ``data:[DONE]``); both are the same SSE event.
* Body-parse rejections (400/415/422 plain text) have the same status codes but pydantic's wording.
* ``/metrics`` renders only the series the replay can observe (see :mod:`.metrics`).
* Error details that come from Rust libraries (``serde_json`` parse errors, the ``jsonschema`` crate's
  meta-schema errors, outlines-core's) are rendered in their wording for the usual cases (see
  :mod:`integration.router_replay.grammar`, :mod:`.tool_calls`); the stock prefixes, error types and
  status codes are exact.
* Chat templates are rendered with ``transformers`` (Jinja2), not minijinja.
* Not replayed: ``--disable-grammar-support``, ``/tokenize``, ``/chat_tokenize``, Vertex,
  SageMaker, KServe routes, ``--api-key``, CORS, Swagger, hub lookups (``model_sha``/``pipeline_tag``
  are null, so ``POST /`` defaults ``return_full_text`` to true, as stock does for local dirs).
* A fatal shard mistake (the stock router would wedge silently) answers 500 ``router_fatal``.
"""

from .app import create_app, info_json
from .generation import ApiConfig, ApiContext
from .metrics import HttpMetrics
from .schemas import ApiError, BodyError
from .serving import BackgroundLoop, HttpStack, UvicornServer
from .tools import tokenizer_chat_template

__all__ = [
    "ApiConfig",
    "ApiContext",
    "ApiError",
    "BackgroundLoop",
    "BodyError",
    "HttpMetrics",
    "HttpStack",
    "UvicornServer",
    "create_app",
    "info_json",
    "tokenizer_chat_template",
]
