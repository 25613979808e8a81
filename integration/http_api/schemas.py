"""Request bodies of the TGI HTTP API, their parsing, and the checks the stock HTTP layer adds on top
of the router's validation (``best_of``, streaming restrictions).

Parsing follows the stock ``serde`` definitions (``router/src/lib.rs``): unknown keys are ignored,
``null`` is accepted only where the stock field is an ``Option``, unsigned fields reject negative
numbers and floats, and a missing ``parameters`` object means the stock ``default_parameters()``
(which samples: ``do_sample = true``). A body that is not JSON is a 400 with a plain-text message, a
body of the wrong shape a 422 with a plain-text message (the axum ``Json`` rejections), a request
without ``Content-Type: application/json`` a 415.

Everything that passes parsing but fails a TGI rule is an :class:`ApiError` whose body is
``{"error": ..., "error_type": ...}``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from integration.router_replay import (
    ClientVisibleError,
    GenerateParameters,
    RouterFatalError,
    SchemaGrammar,
    ValidationError,
)
from integration.router_replay.grammar import serde_json_text

U32 = Annotated[int, Field(ge=0, le=2**32 - 1)]
U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
USize = Annotated[int, Field(ge=0, le=2**64 - 1)]
I32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


class ApiError(Exception):
    """An HTTP error with the stock JSON body ``{"error", "error_type"}``."""

    def __init__(self, status: int, error: str, error_type: str, metric: str | None = None) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.error_type = error_type
        self.metric = metric
        """``tgi_request_failure{err}`` label to count, if any."""

    def body(self) -> dict[str, str]:
        return {"error": self.error, "error_type": self.error_type}


class BodyError(Exception):
    """The axum ``Json`` extractor's rejection: plain-text body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_METRIC_BY_TYPE = {
    "validation": "validation",
    "overloaded": "overloaded",
    "generation": "generation",
    "incomplete_generation": "incomplete",
}


def api_error(err: BaseException) -> ApiError:
    """Map a router-replay error to its HTTP form (``RouterFatalError`` is replay-only: 500 ``router_fatal``)."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, ClientVisibleError):
        return ApiError(err.http_status, str(err), err.error_type, _METRIC_BY_TYPE.get(err.error_type))
    if isinstance(err, RouterFatalError):
        return ApiError(500, str(err), "router_fatal")
    raise err


def validation_error(detail: str) -> ApiError:
    return api_error(ValidationError(detail))


def template_error(detail: str) -> ApiError:
    return ApiError(422, f"Template error: {detail}", "template_error", "template")


def tool_error(detail: str) -> ApiError:
    return ApiError(422, f"Tool error: {detail}", "tool_error")


# -- models -------------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class JsonGrammar(_Model):
    """``GrammarType::Json`` (``json_object`` is its alias): a schema object, or a string holding one."""

    type: Literal["json", "json_object"]
    value: Any


class RegexGrammar(_Model):
    type: Literal["regex"]
    value: str


class JsonSchemaConfig(_Model):
    name: str | None = None
    schema_: Any = Field(alias="schema")


class JsonSchemaGrammar(_Model):
    """``GrammarType::JsonSchema``: ``{"name": ..., "schema": ...}`` (other keys, e.g. ``strict``, ignored)."""

    type: Literal["json_schema"]
    value: JsonSchemaConfig


Grammar = Annotated[JsonGrammar | RegexGrammar | JsonSchemaGrammar, Field(discriminator="type")]
"""The stock ``GrammarType`` (``{"type": ..., "value": ...}``; ``value`` is required for every type)."""


class Parameters(_Model):
    best_of: USize | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: I32 | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    max_new_tokens: U32 | None = None
    return_full_text: bool | None = None
    stop: list[str] = Field(default_factory=list)
    truncate: USize | None = None
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    seed: U64 | None = None
    top_n_tokens: U32 | None = None
    grammar: Grammar | None = None
    adapter_id: str | None = None


def default_parameters() -> Parameters:
    """The stock ``default_parameters()``: used when the body has no ``parameters`` at all."""
    return Parameters(do_sample=True)


class GenerateRequest(_Model):
    inputs: str
    parameters: Parameters = Field(default_factory=default_parameters)


class CompatGenerateRequest(GenerateRequest):
    stream: bool = False


class TextChunk(_Model):
    type: Literal["text"]
    text: str


class ImageUrl(_Model):
    url: str


class ImageChunk(_Model):
    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionDefinition(_Model):
    description: str | None = None
    name: str
    arguments: Any = Field(validation_alias=pydantic.AliasChoices("arguments", "parameters"))

    def stock_json(self) -> dict[str, Any]:
        """As the stock router serialises it: ``arguments`` (never ``parameters``) as a JSON string."""
        return {"description": self.description, "name": self.name, "arguments": serde_json_text(self.arguments)}


class Tool(_Model):
    type: str
    function: FunctionDefinition

    def stock_json(self) -> dict[str, Any]:
        return {"type": self.type, "function": self.function.stock_json()}


class ToolCall(_Model):
    id: str
    type: str
    function: FunctionDefinition

    def stock_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "function": self.function.stock_json()}


_TOOL_CALLS = pydantic.TypeAdapter(list[ToolCall])


class ChatMessage(_Model):
    """The stock ``Message``: ``content`` (text or chunks) or else ``tool_calls`` (an untagged body)."""

    role: str
    content: str | list[TextChunk | ImageChunk] | None = None
    tool_calls: list[Any] | None = None
    name: str | None = None

    @pydantic.model_validator(mode="after")
    def _body(self) -> ChatMessage:
        if self.content is None:  # stock reads tool_calls only when there is no usable content
            if self.tool_calls is None:
                raise ValueError("data did not match any variant of untagged enum MessageBody")
            self.tool_calls = _TOOL_CALLS.validate_python(self.tool_calls, strict=True)
        return self

    @property
    def calls(self) -> list[ToolCall] | None:
        """The tool calls this message is made of (``None`` when it has content)."""
        return self.tool_calls if self.content is None else None

    def text(self, appended: str = "") -> str:
        """The stock ``TextMessage`` conversion: chunks joined, images as ``![](url)``, tool calls as
        the stock JSON; ``appended`` (the tool prompt) goes after the content of a content message."""
        if self.content is None:
            return serde_json_text([call.stock_json() for call in self.tool_calls or []])
        if isinstance(self.content, str):
            return self.content + appended
        return (
            "".join(c.text if isinstance(c, TextChunk) else f"![]({c.image_url.url})" for c in self.content) + appended
        )


class FunctionName(_Model):
    name: str


class TypedChoice(_Model):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(_Model):
    include_usage: bool = False


class ChatRequest(_Model):
    model: str | None = None
    messages: list[ChatMessage]
    frequency_penalty: float | None = None
    logit_bias: Any | None = None
    logprobs: bool | None = None
    top_logprobs: U32 | None = None
    max_tokens: U32 | None = Field(
        default=None, validation_alias=pydantic.AliasChoices("max_tokens", "max_completion_tokens")
    )
    n: U32 | None = None
    presence_penalty: float | None = None
    stop: list[str] | None = None
    stream: bool = False
    seed: U64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Tool] | None = None
    tool_prompt: str | None = None
    tool_choice: str | TypedChoice | None = None
    """``None``/absent = ``auto``; ``"none"``, ``"auto"``, ``"required"``, any other string = that tool's
    name; ``{"type": "function", "function": {"name": ...}}``."""
    response_format: Grammar | None = None
    stream_options: StreamOptions | None = None


class CompletionRequest(_Model):
    model: str | None = None
    prompt: str | list[str]
    max_tokens: U32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    seed: U64 | None = None
    suffix: str | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | None = None

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


# -- parsing ------------------------------------------------------------------------------------


def parse_body(raw: bytes, content_type: str | None, model: type[BaseModel]) -> Any:
    """Parse a JSON body into ``model`` the way the axum ``Json`` extractor accepts or rejects it."""
    mime = (content_type or "").split(";")[0].strip().lower()
    if not (mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))):
        raise BodyError(415, "Expected request with `Content-Type: application/json`")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise BodyError(400, f"Failed to parse the request body as JSON: {err}") from None
    try:
        # strict: no string-to-number or number-to-bool coercion (serde has none); JSON integers
        # still stand for floats, as in serde.
        return model.model_validate(data, strict=True)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise BodyError(
            422, f"Failed to deserialize the JSON body into the target type: {where}: {first['msg']}"
        ) from None


# -- TGI rules on top of the router's validation --------------------------------------------------


def sampling(p: Parameters) -> bool:
    return p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))


def check_best_of(p: Parameters, max_best_of: int) -> int:
    """``best_of`` checks in the stock order; returns the number of sequences to generate."""
    best_of = 1 if p.best_of is None else p.best_of
    if best_of > 1 or p.best_of == 0:
        if max_best_of == 1 and best_of != 1:
            raise validation_error("`best_of` != 1 is not allowed for this endpoint")
        if best_of > max_best_of:
            raise validation_error(f"`best_of` must be > 0 and <= {max_best_of}. Given: {best_of}")
    if best_of > 1:
        if not sampling(p):
            raise validation_error("you must use sampling when `best_of` is > 1")
        if p.seed is not None:
            raise validation_error("`seed` must not be set when `best_of` > 1")
    return max(best_of, 1)


def check_stream(p: Parameters) -> None:
    """What ``generate_stream_internal`` rejects before scheduling (sent as the only SSE event)."""
    if (1 if p.best_of is None else p.best_of) != 1:
        raise validation_error("`best_of` != 1 is not supported when streaming tokens")
    if p.decoder_input_details:
        raise validation_error("`decoder_input_details` == true is not supported when streaming tokens")


def router_grammar(grammar: Any) -> str | SchemaGrammar | None:
    """The router replay's grammar: a regex as is; schemas are validated and compiled by the replay's
    validation (:mod:`integration.router_replay.grammar`), after the input checks, as stock does."""
    if grammar is None:
        return None
    if isinstance(grammar, RegexGrammar):
        return grammar.value
    if isinstance(grammar, JsonSchemaGrammar):
        return SchemaGrammar(grammar.value.schema_, kind="json_schema")
    return SchemaGrammar(grammar.value, kind="json")


def router_parameters(p: Parameters, *, add_special_tokens: bool, seed: int | None = None) -> GenerateParameters:
    """The router replay's request parameters for a parsed ``parameters`` object."""
    return GenerateParameters(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        typical_p=p.typical_p,
        do_sample=p.do_sample,
        seed=p.seed if seed is None else seed,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        stop=list(p.stop),
        truncate=p.truncate,
        decoder_input_details=p.decoder_input_details,
        top_n_tokens=p.top_n_tokens,
        watermark=p.watermark,
        grammar=router_grammar(p.grammar),
        adapter_id=p.adapter_id,
        add_special_tokens=add_special_tokens,
    )
