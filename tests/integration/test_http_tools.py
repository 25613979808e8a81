"""``tools`` / ``tool_choice`` on the chat route, as the stock router does them: the tool grammar (with
``no_tool`` under ``auto``), the tool prompt in the chat template, generated JSON -> ``tool_calls``
(streaming and not), the ``no_tool`` retry without tools, and the stock 422 bodies. Fake shard; a
scripted mutate hook makes grammar-constrained requests answer with chosen tokens."""

from __future__ import annotations

import json
import re

import pytest
from huggingface_hub import InferenceClient
from outlines_core.json_schema import build_regex_from_schema

from integration.http_api.fake import fake_http_stack
from integration.http_api.schemas import ChatMessage, Tool
from integration.http_api.tool_calls import NO_TOOL, ToolCallStream, next_tool_call_id, parse_output
from integration.http_api.tools import DEFAULT_TOOL_PROMPT, chosen_tools, render_chat, template_uses_tools, tool_schema
from integration.router_replay.fake_shard import FakeShardConfig
from tests.integration.scripted_answers import ScriptedAnswers
from tests.integration.test_http_protocol import call

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "clock", "arguments": {"type": "object"}}}
TOOLS = [WEATHER, CLOCK]
MESSAGES = [{"role": "user", "content": "hi"}]
CALL_PIECES = ['{"function": {"_name": "get_weather",', ' "city": "Paris', '", "unit": "c"', "}}"]
CALL_ARGUMENTS = '{"city":"Paris","unit":"c"}'


@pytest.fixture(scope="module")
def stack():
    with fake_http_stack(FakeShardConfig(eos_after=None)) as s:
        yield s


@pytest.fixture()
def script(stack):
    def install(pieces: list[str]) -> ScriptedAnswers:
        hook = ScriptedAnswers(stack.shards[0], pieces)
        stack.shards[0].mutate = hook
        return hook

    yield install
    stack.shards[0].mutate = None


def prefills(stack):
    return [r for method, c in stack.shards[0].calls if method == "Prefill" for r in c.batch.requests]


def chat(stack, **body):
    status, headers, payload = call(stack, "POST", "/v1/chat/completions", {"messages": MESSAGES, **body})
    return status, (json.loads(payload) if not body.get("stream") else payload)


def sse_events(payload: bytes) -> list:
    events = [e for e in payload.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    return [json.loads(e.removeprefix(b"data:")) for e in events[:-1]]


# -- tools -> grammar --------------------------------------------------------------------------------


def test_tool_schema_is_the_stock_one():
    tools = [Tool.model_validate(t) for t in TOOLS]
    schema = tool_schema(chosen_tools(tools, None))
    assert schema == {
        "$functions": {
            "get_weather": {
                "description": "Get the weather",
                "additionalProperties": False,
                "properties": {
                    "_name": {"type": "string", "const": "get_weather"},
                    "city": {"type": "string"},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["_name", "city"],
            },
            "clock": {
                "description": "",
                "additionalProperties": False,
                "properties": {"_name": {"type": "string", "const": "clock"}},
                "required": ["_name"],
            },
            "no_tool": {
                "description": "Open ended response with no specific tool selected",
                "additionalProperties": False,
                "properties": {"_name": {"type": "string", "const": "no_tool"}},
                "required": ["_name"],
            },
        },
        "properties": {
            "function": {
                "anyOf": [
                    {"$ref": "#/$functions/get_weather"},
                    {"$ref": "#/$functions/clock"},
                    {"$ref": "#/$functions/no_tool"},
                ]
            }
        },
    }
    regex = build_regex_from_schema(json.dumps(schema))
    assert re.fullmatch(regex, '{"function": {"_name": "get_weather", "city": "Paris", "unit": "c"}}')
    assert re.fullmatch(regex, '{"function": {"_name": "no_tool"}}')
    assert not re.fullmatch(regex, '{"function": {"_name": "get_weather", "unit": "c"}}')  # city is required


def test_tool_choice_selects_the_tools():
    tools = [Tool.model_validate(t) for t in TOOLS]
    names = lambda chosen: None if chosen is None else [t.function.name for t in chosen]  # noqa: E731
    assert names(chosen_tools(tools, "auto")) == ["get_weather", "clock", "no_tool"]
    assert names(chosen_tools(tools, "required")) == ["get_weather", "clock"]
    assert names(chosen_tools(tools, "clock")) == ["clock"]
    assert chosen_tools(tools, "none") is None and chosen_tools([], "required") is None
    quirky = Tool.model_validate(
        {
            "type": "function",
            "function": {"name": "t", "parameters": {"properties": {}, "additionalProperties": "true"}},
        }
    )  # stock reads the flag as the *string* "true"
    assert tool_schema([quirky])["$functions"]["t"]["additionalProperties"] is True


def test_grammar_and_prompt_reach_the_shard(stack, script):
    hook = script(CALL_PIECES)
    status, _ = chat(stack, tools=TOOLS, max_tokens=20)
    assert status == 200
    [(_, regex)] = hook.seen
    tools = [Tool.model_validate(t) for t in TOOLS]
    assert regex == build_regex_from_schema(json.dumps(tool_schema(chosen_tools(tools, None))))
    offered = [t.stock_json() for t in chosen_tools(tools, None)]
    assert offered[0]["function"]["arguments"] == json.dumps(WEATHER["function"]["parameters"], separators=(",", ":"))
    tools_json = json.dumps(offered, separators=(",", ":"))
    assert prefills(stack)[-1].inputs == f"<user>hi\n---\n{tools_json}\n{DEFAULT_TOOL_PROMPT}<assistant>"
    chat(stack, tools=TOOLS, tool_choice="clock", tool_prompt="Use one.", max_tokens=20)
    clock_json = json.dumps([tools[1].stock_json()], separators=(",", ":"))
    assert prefills(stack)[-1].inputs == f"<user>hi\n---\n{clock_json}\nUse one.<assistant>"


def test_tool_choice_none_is_a_plain_chat(stack, script):
    hook = script(CALL_PIECES)
    status, out = chat(stack, tools=TOOLS, tool_choice="none", max_tokens=3)
    assert status == 200 and out["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert hook.seen == [] and prefills(stack)[-1].inputs == "<user>hi<assistant>"


def test_template_that_reads_tools_gets_them_and_only_the_prompt():
    assert template_uses_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}")
    assert not template_uses_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    seen = {}

    def render(messages, tools=None):
        seen.update(messages=messages, tools=tools)
        return "prompt"

    render.uses_tools = True
    tools = [Tool.model_validate(WEATHER)]
    render_chat(render, [ChatMessage.model_validate(m) for m in MESSAGES], tools, None)
    assert seen["messages"] == [{"role": "user", "content": "hi\n---\n" + DEFAULT_TOOL_PROMPT}]
    assert seen["tools"] == [tools[0].stock_json()]


@pytest.mark.parametrize(
    "body, error",
    [
        ({"tool_choice": "nope"}, "Tool error: Tool with name nope not found"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "Tool error: Tool with name nope not found",
        ),
        ({"response_format": {"type": "regex", "value": "a"}}, "Tool error: Grammar and tools are mutually exclusive"),
    ],
)
def test_tool_errors_are_422(stack, body, error):
    status, out = chat(stack, tools=TOOLS, **body)
    assert (status, out) == (422, {"error": error, "error_type": "tool_error"})


def test_malformed_tools_are_body_errors(stack):
    for tools in ([{"type": "function", "function": {"name": "x"}}], [{"function": {"name": "x", "parameters": {}}}]):
        status, _, payload = call(stack, "POST", "/v1/chat/completions", {"messages": MESSAGES, "tools": tools})
        assert status == 422 and payload.startswith(b"Failed to deserialize the JSON body")


# -- generated JSON -> tool_calls ----------------------------------------------------------------------


def test_tool_call_answer(stack, script):
    script(CALL_PIECES)
    status, out = chat(stack, tools=TOOLS, max_tokens=20)
    assert status == 200
    assert out["choices"][0]["message"] == {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "0",
                "type": "function",
                "function": {"description": None, "name": "get_weather", "arguments": CALL_ARGUMENTS},
            }
        ],
    }
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(CALL_PIECES) + 1


def test_no_tool_asks_again_without_tools(stack, script):
    hook = script(['{"function": {"_name": "no_tool"', "}}"])
    status, out = chat(stack, tools=TOOLS, max_tokens=5)
    first, retry = prefills(stack)[-2:]
    assert status == 200 and len(hook.seen) == 1
    assert retry.inputs == "<user>hi<assistant>" and retry.parameters.grammar == ""
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "abcde"}
    # stock: the retry's text and prompt length, the first answer's finish reason and token count
    assert out["usage"] == {
        "prompt_tokens": len(retry.inputs),
        "completion_tokens": 3,
        "total_tokens": len(retry.inputs) + 3,
    }
    assert out["choices"][0]["finish_reason"] == "stop"


def test_unparsable_answer_is_a_tool_error(stack, script):
    script(CALL_PIECES)
    status, out = chat(stack, tools=TOOLS, max_tokens=2)  # cut inside the call
    text = "".join(CALL_PIECES[:2])
    quoted = '"' + text.replace('"', '\\"') + '"'  # Rust's {:?}
    assert (status, out["error_type"]) == (422, "tool_error")
    assert out["error"] == (
        f"Tool error: Failed to parse generated text: EOF while parsing a string at line 1 column {len(text)} {quoted}"
    )
    with pytest.raises(Exception, match=r"missing field `function` at line 1 column 2 \"\{\}\""):
        parse_output("{}")


def test_streamed_tool_call(stack, script):
    script(CALL_PIECES)
    status, payload = chat(stack, tools=TOOLS, max_tokens=20, stream=True, stream_options={"include_usage": True})
    events = sse_events(payload)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [d["tool_calls"][0] for d in deltas]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", "{"),
        (None, ' "city": "Paris'),
        (None, '", "unit": "c"'),
        (None, "}"),
    ]
    assert all(c["id"] == "0" and c["index"] == 0 and c["type"] == "function" for c in calls)
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == json.loads(CALL_ARGUMENTS)
    # the final EOS token is swallowed with its finish_reason (stock); the usage chunk still comes
    assert all(e["choices"][0]["finish_reason"] is None for e in events if e["choices"])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(CALL_PIECES) + 1


def test_streamed_no_tool_restarts_without_tools(stack, script):
    script(['{"function": {"_name": "no_tool"', "}}"])
    status, payload = chat(stack, tools=TOOLS, max_tokens=3, stream=True)
    events = sse_events(payload)
    assert [e["choices"][0]["delta"] for e in events] == [{"role": "assistant", "content": c} for c in "abc"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert prefills(stack)[-1].parameters.grammar == ""


def test_stream_state_machine_and_call_ids():
    stream = ToolCallStream()
    assert stream.push('{"function": {"_na') is None
    assert stream.push('me": "clock"') == ("{", "clock")
    assert stream.push(', "a": 1') == (', "a": 1', None)
    assert stream.push("}}  ") == ("}", None)  # whole call: trailing whitespace and one brace cut
    assert stream.push("</s>") is None  # buffering again: the end of the stream is swallowed
    assert ToolCallStream().push('{"function": {"_name": "no_tool"') is NO_TOOL
    history = [
        ChatMessage.model_validate(m)
        for m in (
            {
                "role": "assistant",
                "tool_calls": [{"id": "4", "type": "function", "function": {"name": "clock", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "12:00"},
        )
    ]
    assert next_tool_call_id([]) == "0" and next_tool_call_id(history) == "5"
    history[0].tool_calls[0].id = "call_x"
    assert re.fullmatch(r"[0-9a-f-]{36}", next_tool_call_id(history))


def test_tool_call_history_is_rendered_as_stock_json(stack, script):
    script(CALL_PIECES)
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "tool_calls": [{"id": "0", "type": "function", "function": {"name": "clock", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "12:00"},
    ]
    status, payload = chat(stack, messages=messages, tools=TOOLS, max_tokens=20, stream=True)
    inputs = prefills(stack)[-1].inputs
    assert inputs.startswith(
        '<user>hi<assistant>[{"id":"0","type":"function","function":'
        '{"description":null,"name":"clock","arguments":"\\"{}\\""}}]<tool>12:00\n---\n'
    )
    assert sse_events(payload)[0]["choices"][0]["delta"]["tool_calls"][0]["id"] == "1"
    status, _, payload = call(
        stack, "POST", "/v1/chat/completions", {"messages": [{"role": "assistant", "content": None}]}
    )
    assert status == 422  # neither content nor tool_calls


# -- the official client --------------------------------------------------------------------------------


def test_inference_client_tools(stack, script):
    client = InferenceClient(base_url=stack.base_url)
    script(CALL_PIECES)
    out = client.chat_completion(MESSAGES, tools=TOOLS, tool_choice="get_weather", max_tokens=20)
    [tool_call] = out.choices[0].message.tool_calls
    assert out.choices[0].message.content is None
    assert (tool_call.id, tool_call.function.name, json.loads(tool_call.function.arguments)) == (
        "0",
        "get_weather",
        {"city": "Paris", "unit": "c"},
    )
    chunks = list(client.chat_completion(MESSAGES, tools=TOOLS, max_tokens=20, stream=True))
    name = "".join(c.choices[0].delta.tool_calls[0].function.name or "" for c in chunks)
    arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments for c in chunks)
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris", "unit": "c"}
