"""End to end: official clients -> TGI HTTP API -> v3 router replay -> the real ``text-generation-server``
CLI (spawned exactly like the launcher) with a tiny random Llama on CPU."""

from __future__ import annotations

import json
import socket
import tempfile
from urllib.parse import urlparse

import jsonschema
import pytest
from huggingface_hub import InferenceClient

from integration.http_api import HttpStack
from integration.launcher_spawn import LaunchedShards, LauncherOptions
from tests.helpers.tiny_models import write_tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from transformers import AutoTokenizer

    model = write_tiny_model("llama", tmp_path_factory.mktemp("http-llama"), seed=3)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATE  # the tiny tokenizer has none
    tokenizer.save_pretrained(model)
    uds = tempfile.mkdtemp(prefix="h", dir="/tmp") + "/tgs"
    opts = LauncherOptions(
        uds_path=uds, env={"TGI_PAGED_NUM_BLOCKS": "64", "PREFIX_CACHING": "0"}, enable_prefill_logprobs=True
    )  # REQUEST_LOGPROBS=1: decoder_input_details works
    with LaunchedShards(str(model), opts, ready_timeout=300) as shards:
        with HttpStack(uds, str(model), router_kwargs={"max_batch_prefill_tokens": 256}) as s:
            s.shards = shards
            yield s
        assert not shards.crashed()


def test_chat_completion(stack):
    client = InferenceClient(base_url=stack.base_url, timeout=120)
    messages = [{"role": "user", "content": "hello world"}]
    out = client.chat_completion(messages, model="tgi", max_tokens=6, temperature=0)
    assert 1 <= out.usage.completion_tokens <= 6 and out.usage.prompt_tokens > 3
    assert out.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.chat_completion(messages, model="tgi", max_tokens=6, temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == out.choices[0].message.content  # greedy: the same answer either way


def test_text_generation_greedy_stream_and_stop(stack):
    client = InferenceClient(base_url=stack.base_url, timeout=120)
    first = client.text_generation("hello world", max_new_tokens=8, details=True, return_full_text=False)
    again = client.text_generation("hello world", max_new_tokens=8, details=True, return_full_text=False)
    assert first.generated_text == again.generated_text and first.details.generated_tokens >= 1
    streamed = list(
        client.text_generation("hello world", max_new_tokens=8, stream=True, details=True, return_full_text=False)
    )
    assert [e.token.id for e in streamed] == [t.id for t in first.details.tokens]
    assert streamed[-1].generated_text == first.generated_text
    texts = [t.text for t in first.details.tokens]
    index = next(
        (
            i
            for i in range(1, len(texts))
            if texts[i].strip() and texts[i].isprintable() and texts[i] not in "".join(texts[:i])
        ),
        None,
    )
    if index is None:
        pytest.skip(f"no usable stop sequence in {texts!r}")
    stopped = client.text_generation(
        "hello world", max_new_tokens=8, details=True, return_full_text=False, stop=[texts[index]]
    )
    assert stopped.details.finish_reason == "stop_sequence"
    assert stopped.details.generated_tokens == index + 1


def test_text_generation_client_and_errors(stack):
    tg = pytest.importorskip("text_generation")
    client = tg.Client(stack.base_url, timeout=120)
    response = client.generate("the quick brown fox", max_new_tokens=5, decoder_input_details=True)
    assert response.details.generated_tokens <= 5
    assert response.details.prefill[0].logprob is None and len(response.details.prefill) > 1
    sampled = client.generate("the quick brown fox", max_new_tokens=5, do_sample=True, seed=7)
    assert sampled.details.seed == 7
    with pytest.raises(tg.errors.ValidationError, match="must be <= 512"):
        client.generate("the quick brown fox", max_new_tokens=600)


def test_disconnect_mid_stream_then_keep_serving(stack):
    url = urlparse(stack.base_url)

    def start(prompt: str) -> socket.socket:
        body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": 60}}).encode()
        sock = socket.create_connection((url.hostname, url.port), timeout=60)
        sock.sendall(
            b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        return sock

    def read(sock: socket.socket, until: bytes) -> bytes:
        buf = b""
        while until not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
        return buf

    leaver, stayer = start("one two three"), start("four five six")
    read(leaver, b'"index":3,')
    read(stayer, b'"index":3,')
    leaver.close()
    rest = read(stayer, b'"generated_text":"')
    stayer.close()
    assert b'"details":null' in rest
    methods = [m for m, _ in stack.router.rpc_log]
    assert "FilterBatch" in methods or "ClearCache" in methods[4:], methods[-20:]
    assert stack.router.stats.requests_dropped >= 1
    client = InferenceClient(base_url=stack.base_url, timeout=120)
    assert (
        client.text_generation(
            "still here", max_new_tokens=2, details=True, return_full_text=False
        ).details.generated_tokens
        >= 1
    )


def test_chat_completion_with_the_clients_default_model(stack):
    out = InferenceClient(base_url=stack.base_url, timeout=120).chat_completion(
        [{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert out.usage.completion_tokens >= 1


# A schema a random model finishes quickly: every value is an enum, a boolean or a bounded array.
PICK = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["ok", "color", "tags"],
    "additionalProperties": False,
}
LAMP = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}, "room": {"enum": ["hall", "den"]}},
    "required": ["on", "room"],
}


def test_json_schema_and_tools_with_the_official_clients(stack):
    """The clients' grammar parameters, unchanged: the stand-in compiles the schema (tool grammar
    included) to a regex, the shard decodes under it, and the answers validate against the schema."""
    client = InferenceClient(base_url=stack.base_url, timeout=300)
    out = client.chat_completion(
        [{"role": "user", "content": "pick a color"}],
        model="tgi",
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK}},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PICK)

    tools = [{"type": "function", "function": {"name": "lamp", "description": "Switch the lamp", "parameters": LAMP}}]
    # tool_choice auto (the default): the lamp or no_tool; greedy, this tiny model calls the lamp
    out = client.chat_completion(
        [{"role": "user", "content": "turn on the lamp"}],
        model="tgi",
        max_tokens=100,
        temperature=0,
        tools=tools,
        tool_prompt="Call a tool.",
    )
    [call] = out.choices[0].message.tool_calls
    assert out.choices[0].message.content is None
    assert (call.id, call.type, call.function.name) == ("0", "function", "lamp")
    jsonschema.validate(json.loads(call.function.arguments), LAMP)

    tg = pytest.importorskip("text_generation")
    response = tg.Client(stack.base_url, timeout=300).generate(
        "hello world", max_new_tokens=100, grammar=tg.types.Grammar(type=tg.types.GrammarType.Json, value=PICK)
    )
    assert response.details.finish_reason == tg.types.FinishReason.EndOfSequenceToken
    jsonschema.validate(json.loads(response.generated_text), PICK)
