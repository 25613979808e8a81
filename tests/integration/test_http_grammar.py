"""Grammars through the HTTP stand-in (``/generate`` ``parameters.grammar``, chat ``response_format``):
schemas compiled to the regex the stock router sends (outlines-core), the stock 422 bodies, and the
official clients' grammar parameters reaching the shard as ``GRAMMAR_TYPE_REGEX``. Fake shard."""

from __future__ import annotations

import asyncio
import json

import pytest
from huggingface_hub import InferenceClient
from outlines_core.json_schema import build_regex_from_schema

from integration.http_api.fake import fake_http_stack
from integration.router_replay import GenerateParameters, SchemaGrammar, ValidationError
from integration.router_replay.fake_shard import FakeShardConfig
from integration.router_replay.grammar import grammar_regex, serde_json_text
from tests.integration.test_http_protocol import call
from tgi_paged_backend.server.pb import generate_pb2 as pb

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
    "required": ["ok", "color"],
}
REGEX = build_regex_from_schema(json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def stack():
    with fake_http_stack(FakeShardConfig(eos_after=6)) as s:
        yield s


def last_request(stack) -> pb.Request:
    return [r for method, c in stack.shards[0].calls if method == "Prefill" for r in c.batch.requests][-1]


def generate(stack, grammar, inputs: str = "hi", **parameters):
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 2, "grammar": grammar, **parameters}}
    status, _, payload = call(stack, "POST", "/generate", body)
    return status, payload


def invalid(detail: str) -> dict[str, str]:
    return {"error": f"Input validation error: {detail}", "error_type": "validation"}


# -- conversion (the replay's validation) ----------------------------------------------------------


def test_every_schema_form_compiles_to_outlines_regex():
    assert grammar_regex(SchemaGrammar(SCHEMA)) == REGEX
    assert grammar_regex(SchemaGrammar(json.dumps(SCHEMA))) == REGEX  # a string value is parsed again
    assert grammar_regex(SchemaGrammar(SCHEMA, kind="json_schema")) == REGEX
    assert grammar_regex("[ab]+") == "[ab]+" and grammar_regex(None) is None  # regexes pass unchecked


def test_serde_json_text_matches_serde_formatting():
    assert serde_json_text({"b": [1, 2.5, True, None], "a": "é\n"}) == '{"b":[1,2.5,true,null],"a":"é\\n"}'
    assert serde_json_text([1e16, 1e-7, 100000.0]) == "[1e16,1e-7,100000.0]"


def test_validation_compiles_schemas_after_the_input_checks():
    async def validate(params):
        from integration.router_replay.fake_shard import CharTokenizer
        from integration.router_replay.validation import ValidationLimits, Validator

        return await Validator(CharTokenizer(), ValidationLimits(max_input_tokens=8, max_total_tokens=16)).validate(
            "hello", params
        )

    assert asyncio.run(validate(GenerateParameters(max_new_tokens=2, grammar=SchemaGrammar(SCHEMA)))).grammar == REGEX
    bad = SchemaGrammar({"type": "foo", "properties": {}})
    with pytest.raises(ValidationError, match="must be <= 16"):  # length first, as stock
        asyncio.run(validate(GenerateParameters(max_new_tokens=50, grammar=bad)))
    with pytest.raises(ValidationError, match="grammar is not valid"):
        asyncio.run(validate(GenerateParameters(max_new_tokens=2, grammar=bad)))


# -- /generate ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grammar",
    [
        {"type": "json", "value": SCHEMA},
        {"type": "json_object", "value": SCHEMA},
        {"type": "json", "value": json.dumps(SCHEMA)},
        {"type": "json_schema", "value": {"name": "answer", "strict": True, "schema": SCHEMA}},
        {"type": "json_schema", "value": {"schema": SCHEMA}},
    ],
)
def test_generate_sends_the_compiled_regex(stack, grammar):
    status, _ = generate(stack, grammar)
    request = last_request(stack)
    assert status == 200
    assert (request.parameters.grammar_type, request.parameters.grammar) == (pb.GRAMMAR_TYPE_REGEX, REGEX)


def test_regex_grammar_is_sent_as_is(stack):
    assert generate(stack, {"type": "regex", "value": "(yes|no)"})[0] == 200
    assert last_request(stack).parameters.grammar == "(yes|no)"


@pytest.mark.parametrize(
    "grammar, detail",
    [
        ({"type": "json", "value": 3}, "grammar is not supported"),
        ({"type": "json", "value": None}, "grammar is not supported"),
        ({"type": "json", "value": "not json"}, "grammar is not valid: expected value at line 1 column 1"),
        (
            {"type": "json", "value": '{"properties": {'},
            "grammar is not valid: EOF while parsing an object at line 1 column 16",
        ),
        ({"type": "json", "value": "{} x"}, "grammar is not valid: trailing characters at line 1 column 4"),
        ({"type": "json", "value": "[1]"}, 'grammar is not valid: [1] is not of types "boolean", "object"'),
        (
            {"type": "json", "value": {"type": "foo", "properties": {}}},
            "grammar is not valid: \"foo\" is not valid under any of the schemas listed in the 'anyOf' keyword",
        ),
        (
            {"type": "json", "value": {"properties": {"a": {"minLength": -1}}}},
            "grammar is not valid: -1 is less than the minimum of 0",
        ),
        ({"type": "json", "value": {"properties": 3}}, 'grammar is not valid: 3 is not of type "object"'),
        ({"type": "json", "value": {"type": "object"}}, "grammar is not valid: Grammar must have a 'properties' field"),
        (
            {"type": "json_schema", "value": {"name": "x", "schema": {"type": "object"}}},
            "grammar is not valid: Grammar must have a 'properties' field",
        ),
    ],
)
def test_invalid_grammars_get_the_stock_422(stack, grammar, detail):
    status, payload = generate(stack, grammar)
    assert (status, json.loads(payload)) == (422, invalid(detail))


def test_schema_outlines_cannot_compile(stack):
    schema = {"properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(ValueError) as outlines_error:
        build_regex_from_schema(json.dumps(schema))
    status, payload = generate(stack, {"type": "json", "value": schema})
    assert (status, json.loads(payload)) == (422, invalid(f"cannot compile regex from schema: {outlines_error.value}"))


def test_grammar_error_comes_after_the_other_checks_and_streams_as_an_event(stack):
    bad = {"type": "json", "value": {"type": "object"}}
    status, payload = generate(stack, bad, temperature=-1.0)
    assert json.loads(payload) == invalid("`temperature` must be strictly positive")
    status, payload = generate(stack, bad, inputs="x" * 1100)
    assert json.loads(payload)["error"].startswith("Input validation error: `inputs` tokens + `max_new_tokens`")
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 2, "grammar": bad}}
    status, _, stream = call(stack, "POST", "/generate_stream", body)
    assert status == 200
    assert (
        stream
        == b"data:"
        + json.dumps(
            invalid("grammar is not valid: Grammar must have a 'properties' field"), separators=(",", ":")
        ).encode()
        + b"\n\n"
    )


@pytest.mark.parametrize(
    "grammar",
    [
        {"type": "json"},
        {"type": "text", "value": "x"},
        {"type": "regex", "value": {}},
        {"type": "json_schema", "value": {"name": "x"}},
    ],
)
def test_malformed_grammar_bodies_are_422_plain_text(stack, grammar):
    status, headers, payload = call(stack, "POST", "/generate", {"inputs": "hi", "parameters": {"grammar": grammar}})
    assert status == 422 and payload.startswith(b"Failed to deserialize the JSON body into the target type: ")
    assert headers["content-type"].startswith("text/plain")


def test_text_generation_client_grammar(stack):
    tg = pytest.importorskip("text_generation")
    client = tg.Client(stack.base_url)
    client.generate("hi", max_new_tokens=2, grammar=tg.types.Grammar(type=tg.types.GrammarType.Json, value=SCHEMA))
    assert last_request(stack).parameters.grammar == REGEX
    client.generate("hi", max_new_tokens=2, grammar=tg.types.Grammar(type=tg.types.GrammarType.Regex, value="[ab]+"))
    assert last_request(stack).parameters.grammar == "[ab]+"
    with pytest.raises(tg.errors.ValidationError, match="Grammar must have a 'properties' field"):
        client.generate("hi", grammar=tg.types.Grammar(type=tg.types.GrammarType.Json, value={"type": "object"}))


def test_inference_client_text_generation_grammar(stack):
    client = InferenceClient(base_url=stack.base_url)
    client.text_generation("hi", max_new_tokens=2, grammar={"type": "json", "value": SCHEMA})
    assert last_request(stack).parameters.grammar == REGEX


# -- chat response_format -----------------------------------------------------------------------------


def test_chat_response_format_forms(stack):
    client = InferenceClient(base_url=stack.base_url)
    messages = [{"role": "user", "content": "hi"}]
    for response_format in (
        {"type": "json", "value": SCHEMA},
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    ):
        # the client turns OpenAI's json_schema form into TGI's {"type": "json_object", "value": schema}
        client.chat_completion(messages, max_tokens=2, response_format=response_format)
        assert last_request(stack).parameters.grammar == REGEX
    body = {
        "messages": messages,
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "value": {"name": "a", "schema": SCHEMA}},
    }
    assert call(stack, "POST", "/v1/chat/completions", body)[0] == 200
    assert last_request(stack).parameters.grammar == REGEX


def test_chat_response_format_errors(stack):
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "response_format": {"type": "json", "value": {"type": "object"}}}
    expected = invalid("grammar is not valid: Grammar must have a 'properties' field")
    status, _, payload = call(stack, "POST", "/v1/chat/completions", body)
    assert (status, json.loads(payload)) == (422, expected)
    status, _, payload = call(stack, "POST", "/v1/chat/completions", {**body, "stream": True})
    first = json.loads(payload.split(b"\n\n")[0].removeprefix(b"data:"))
    assert first == {"error": {"message": expected["error"], "http_status_code": 422}}
    body = {"messages": messages, "tools": [], "response_format": {"type": "json", "value": SCHEMA}}
    status, _, payload = call(stack, "POST", "/v1/chat/completions", body)
    assert (status, json.loads(payload)) == (
        422,
        {"error": "Tool error: Grammar and tools are mutually exclusive", "error_type": "tool_error"},
    )
