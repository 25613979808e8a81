"""Byte-level HTTP behaviour of the TGI stand-in (raw ``http.client``, no client library in between)."""

from __future__ import annotations

import http.client
import json
import math
from urllib.parse import urlparse

import pytest

from integration.http_api.fake import fake_http_stack
from integration.http_api.generation import f32
from integration.router_replay.fake_shard import CharTokenizer, FakeShardConfig


@pytest.fixture(scope="module")
def stack():
    with fake_http_stack(FakeShardConfig(eos_after=6)) as s:
        yield s


def call(
    stack, method: str, path: str, body=None, *, content_type: str | None = "application/json", raw: bytes | None = None
):
    url = urlparse(stack.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    headers = {} if content_type is None else {"Content-Type": content_type}
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers=headers)
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, dict(response.getheaders()), payload


def prefill_requests(stack):
    return [r for method, call_ in stack.shards[0].calls if method == "Prefill" for r in call_.batch.requests]


def test_compat_is_a_list_and_generate_an_object(stack):
    status, headers, body = call(stack, "POST", "/", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert status == 200 and body == b'[{"generated_text":"hiab"}]'  # return_full_text defaults to true here
    status, headers, body = call(stack, "POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert status == 200 and body == b'{"generated_text":"ab"}'
    assert headers["x-generated-tokens"] == "2" and headers["x-prompt-tokens"] == "3"
    assert headers["x-compute-characters"] == "2" and headers["x-compute-type"] == "gpu+optimized"
    for name in (
        "x-compute-time",
        "x-total-time",
        "x-validation-time",
        "x-queue-time",
        "x-inference-time",
        "x-time-per-token",
    ):
        assert name in headers


def test_generate_stream_bytes(stack):
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 2, "details": True}}
    status, headers, payload = call(stack, "POST", "/generate_stream", body)
    assert status == 200
    assert headers["content-type"] == "text/event-stream" and headers["x-accel-buffering"] == "no"
    assert payload == (
        b'data:{"index":1,"token":{"id":99,"text":"a","logprob":-0.5,"special":false},'
        b'"generated_text":null,"details":null}\n\n'
        b'data:{"index":2,"token":{"id":100,"text":"b","logprob":-0.5,"special":false},"generated_text":"ab",'
        b'"details":{"finish_reason":"length","generated_tokens":2,"seed":null,"input_length":3}}\n\n'
    )  # no [DONE] on this route


def test_compat_stream_and_top_tokens(stack):
    body = {
        "inputs": "hi",
        "stream": True,
        "parameters": {"max_new_tokens": 1, "top_n_tokens": 1, "return_full_text": False},
    }
    status, _, payload = call(stack, "POST", "/", body)
    event = json.loads(payload.decode().removeprefix("data:"))
    assert status == 200 and list(event) == ["index", "token", "top_tokens", "generated_text", "details"]
    assert event["top_tokens"] == [{"id": 99, "text": "a", "logprob": -0.5, "special": False}]
    assert event["generated_text"] == "a"


@pytest.mark.parametrize(
    "parameters, message",
    [
        ({"best_of": 2}, "`best_of` != 1 is not supported when streaming tokens"),
        ({"decoder_input_details": True}, "`decoder_input_details` == true is not supported when streaming tokens"),
        (
            {"max_new_tokens": 5000},
            "`inputs` tokens + `max_new_tokens` must be <= 1024. Given: 3 `inputs` tokens and 1024 `max_new_tokens`",
        ),
    ],
)
def test_stream_errors_are_200_with_one_event(stack, parameters, message):
    status, _, payload = call(stack, "POST", "/generate_stream", {"inputs": "hi", "parameters": parameters})
    assert status == 200
    assert (
        payload
        == b"data:"
        + json.dumps(
            {"error": f"Input validation error: {message}", "error_type": "validation"}, separators=(",", ":")
        ).encode()
        + b"\n\n"
    )


@pytest.mark.parametrize(
    "parameters, message",
    [
        ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
        ({"best_of": 2, "do_sample": True, "seed": 1}, "`seed` must not be set when `best_of` > 1"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"temperature": 0}, "`temperature` must be strictly positive"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"truncate": 5000}, "`truncate` must be strictly positive and less than 1023. Given: 5000"),
    ],
)
def test_validation_errors(stack, parameters, message):
    status, _, body = call(stack, "POST", "/generate", {"inputs": "hi", "parameters": parameters})
    assert status == 422
    assert json.loads(body) == {"error": f"Input validation error: {message}", "error_type": "validation"}


def test_empty_inputs_and_body_rejections(stack):
    status, _, body = call(stack, "POST", "/generate", {"inputs": ""})
    assert (status, json.loads(body)["error"]) == (422, "Input validation error: `inputs` cannot be empty")
    status, headers, body = call(stack, "POST", "/generate", raw=b"{not json")
    assert status == 400 and headers["content-type"].startswith("text/plain")
    status, _, body = call(stack, "POST", "/generate", {"parameters": {}})
    assert status == 422 and body.startswith(b"Failed to deserialize the JSON body")
    status, _, _ = call(stack, "POST", "/generate", {"inputs": "x", "parameters": {"max_new_tokens": -1}})
    assert status == 422
    status, _, _ = call(stack, "POST", "/generate", {"inputs": "x"}, content_type=None)
    assert status == 415


def test_missing_parameters_means_sampling(stack):
    call(stack, "POST", "/generate", {"inputs": "no params here"})
    request = [r for r in prefill_requests(stack) if r.inputs == "no params here"][-1]
    assert request.parameters.do_sample is True
    call(stack, "POST", "/generate", {"inputs": "empty params here", "parameters": {"max_new_tokens": 1}})
    request = [r for r in prefill_requests(stack) if r.inputs == "empty params here"][-1]
    assert request.parameters.do_sample is False


def test_chat_stream_bytes_and_terminator(stack):
    body = {"model": "tgi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}
    status, headers, payload = call(stack, "POST", "/v1/chat/completions", body)
    events = payload.split(b"\n\n")
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert events[0].startswith(b'data:{"object":"chat.completion.chunk","id":"","created":')
    assert events[-2:] == [b"data: [DONE]", b""]  # see integration/http_api/chat.py: space kept for huggingface_hub
    chunk = json.loads(events[0].removeprefix(b"data:"))
    assert chunk["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": "a"}, "logprobs": None, "finish_reason": "length"}
    ]
    assert chunk["usage"] is None and chunk["model"] == "fake/model"


def test_chat_stream_error_is_openai_shaped(stack):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "stream": True}
    status, _, payload = call(stack, "POST", "/v1/chat/completions", body)
    first, done, _ = payload.split(b"\n\n")
    error = json.loads(first.removeprefix(b"data:"))["error"]
    assert status == 200 and error["http_status_code"] == 422
    assert error["message"].startswith("Input validation error: `inputs` tokens + `max_new_tokens`")
    assert done == b"data: [DONE]"


def test_chat_continues_a_trailing_assistant_message(stack):
    body = {
        "model": "tgi",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}],
        "max_tokens": 1,
    }
    status, _, _ = call(stack, "POST", "/v1/chat/completions", body)
    assert status == 200
    assert prefill_requests(stack)[-1].inputs == "<user>hi<assistant>Sure"


def test_chat_without_template_and_tools():
    with fake_http_stack(tokenizer=CharTokenizer()) as s:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        status, _, payload = call(s, "POST", "/v1/chat/completions", body)
        assert status == 422 and json.loads(payload) == {
            "error": "Template error: template not found",
            "error_type": "template_error",
        }
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        status, _, payload = call(s, "POST", "/v1/chat/completions", body)  # stock: tools pass, then no template
        assert status == 422 and json.loads(payload)["error_type"] == "template_error"
        body["tool_choice"] = "g"
        status, _, payload = call(s, "POST", "/v1/chat/completions", body)  # ... unless the choice is unknown
        assert status == 422 and json.loads(payload) == {
            "error": "Tool error: Tool with name g not found",
            "error_type": "tool_error",
        }


def test_completions(stack):
    status, _, body = call(stack, "POST", "/v1/completions", {"prompt": ["a", "bb"], "max_tokens": 2})
    out = json.loads(body)
    assert status == 200 and out["object"] == "text_completion"
    assert [c["text"] for c in out["choices"]] == ["ab", "ab"]
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert prefill_requests(stack)[-1].prefill_logprobs is True  # non-stream asks for decoder input details
    status, _, body = call(stack, "POST", "/v1/completions", {"prompt": "a", "suffix": "z"})
    assert status == 422 and json.loads(body)["error_type"] == "suffix not supported"
    status, _, body = call(stack, "POST", "/v1/completions", {"prompt": list("abcde")})
    assert status == 422 and json.loads(body)["error_type"] == "batch size exceeded"
    status, _, payload = call(stack, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2, "stream": True})
    events = payload.split(b"\n\n")
    assert json.loads(events[1].removeprefix(b"data:"))["usage"]["completion_tokens"] == 2
    assert events[-2] == b"data: [DONE]"


def test_info_models_health(stack):
    status, _, body = call(stack, "GET", "/info")
    info = json.loads(body)
    assert list(info) == [
        "model_id",
        "model_sha",
        "model_pipeline_tag",
        "max_concurrent_requests",
        "max_best_of",
        "max_stop_sequences",
        "max_input_tokens",
        "max_total_tokens",
        "validation_workers",
        "max_client_batch_size",
        "router",
        "version",
        "sha",
        "docker_label",
    ]
    assert info["max_input_tokens"] == 1023 and info["router"] == "text-generation-router"
    status, _, body = call(stack, "GET", "/v1/models")
    assert json.loads(body) == {
        "object": "list",
        "data": [{"id": "fake/model", "object": "model", "created": 0, "owned_by": "fake/model"}],
    }
    for path in ("/health", "/ping", "/"):
        assert call(stack, "GET", path)[::2] == (200, b"")
    assert "Health" in stack.shards[0].methods()


def test_metrics(stack):
    call(stack, "POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    call(stack, "POST", "/generate", {"inputs": "hi", "parameters": {"top_p": 2.0}})
    status, headers, body = call(stack, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    for series in (
        "tgi_request_count ",
        "tgi_request_success ",
        'tgi_request_failure{err="validation"} ',
        "tgi_queue_size 0",
        "tgi_batch_current_size 0",
        "tgi_batch_max_total_tokens 4096",
        'tgi_batch_inference_count{method="prefill"} ',
        'tgi_request_duration_bucket{le="+Inf"} ',
        "tgi_request_generated_tokens_count ",
        "tgi_request_input_length_sum ",
    ):
        assert series in text, series
    assert "tgi_request_count_total" not in text and "_created" not in text  # stock exporter naming


def test_f32_digits():
    assert f32(-4.186315059661865) == -4.186315
    assert f32(-0.5) == -0.5
    assert f32(math.nan) is None


def test_keep_alive_comment_while_the_shard_is_silent():
    from integration.http_api import ApiConfig

    with fake_http_stack(api_config=ApiConfig(model_id="m", keep_alive_s=0.05)) as s:
        s.set_gate("Decode", open=False)
        url = urlparse(s.base_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
        conn.request(
            "POST",
            "/generate_stream",
            body=json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        buf = b""
        while b":\n\n" not in buf.split(b"\n\n", 1)[-1]:
            buf += response.read1(4096)
        s.set_gate("Decode", open=True)
        buf += response.read()
        conn.close()
        assert buf.startswith(b'data:{"index":1,')
        assert b"\n\n:\n\n" in buf and buf.endswith(b'"details":null}\n\n')
