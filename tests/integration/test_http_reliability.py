"""Reliability drills for the HTTP stand-in over the router replay over a fake shard."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from urllib.parse import urlparse

import pytest
from huggingface_hub import AsyncInferenceClient, InferenceClient

from integration.http_api.fake import fake_http_stack
from integration.router_replay import RouterFatalError
from integration.router_replay.fake_shard import FakeShardConfig


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def open_stream(base_url: str, path: str, body: dict) -> socket.socket:
    """Send a streaming request on a raw socket and return it unread (the test decides when to hang up)."""
    url = urlparse(base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed before {marker!r}"
        buf += chunk
    return buf


def test_client_disconnect_mid_stream_filters_the_batch():
    with fake_http_stack() as s:
        shard = s.shards[0]
        s.set_gate("Prefill", open=False)
        s.set_gate("Decode", open=False)
        leaver = open_stream(s.base_url, "/generate_stream", {"inputs": "leave", "parameters": {"max_new_tokens": 200}})
        wait_for(lambda: "Prefill" in shard.methods())
        result = {}
        stayer = threading.Thread(
            target=lambda: result.setdefault(
                "text",
                InferenceClient(base_url=s.base_url).text_generation("stay", max_new_tokens=30, return_full_text=False),
            )
        )
        stayer.start()
        wait_for(lambda: s.router.stats.requests_scheduled == 2)
        s.set_gate("Prefill", open=True)  # both get prefilled, then the Decode of both is held
        read_until(leaver, b'"index":1')
        wait_for(lambda: "Decode" in shard.methods())
        assert s.router.stats.concurrency_peak == 2
        leaver.close()  # the HTTP client hangs up mid-stream
        time.sleep(0.3)
        s.set_gate("Decode", open=True)
        stayer.join(20)
        assert result["text"] == "abcdefghijklmnopqrstuvwxyzabcd"
        filters = [call for method, call in shard.calls if method == "FilterBatch"]
        assert filters, (shard.methods(), s.router.stats)
        assert s.router.stats.requests_dropped == 1
        kept = {rid for call in filters for rid in call.request_ids}
        prefilled = [r for m, c in shard.calls if m == "Prefill" for r in c.batch.requests]
        leaver_id = next(r.id for r in prefilled if r.inputs == "leave")
        assert leaver_id not in kept
        # the shard keeps serving
        assert (
            InferenceClient(base_url=s.base_url).text_generation("again", max_new_tokens=2, return_full_text=False)
            == "ab"
        )


def test_client_disconnect_while_waiting_non_stream():
    with fake_http_stack() as s:
        s.set_gate("Decode", open=False)
        sock = open_stream(s.base_url, "/generate", {"inputs": "bye", "parameters": {"max_new_tokens": 50}})
        wait_for(lambda: "Decode" in s.shards[0].methods())
        sock.close()
        time.sleep(1.0)  # the handler polls for the disconnect
        s.set_gate("Decode", open=True)
        wait_for(lambda: s.router.stats.requests_dropped + s.router.stats.requests_finished >= 1)
        assert s.router.stats.requests_dropped == 1
        assert (
            InferenceClient(base_url=s.base_url).text_generation("x", max_new_tokens=1, return_full_text=False) == "a"
        )


def test_max_new_tokens_above_the_limit_is_422():
    with fake_http_stack() as s:
        client = InferenceClient(base_url=s.base_url)
        with pytest.raises(Exception) as info:  # huggingface_hub raises ValidationError on 422
            client.text_generation("hello", max_new_tokens=1020)
        assert "`inputs` tokens + `max_new_tokens` must be <= 1024" in str(info.value)
        assert "ValidationError" in type(info.value).__name__
        assert [m for m in s.shards[0].methods() if m in ("Prefill", "Decode")] == []  # nothing reached the shard


def test_100_concurrent_streams_complete():
    with fake_http_stack(FakeShardConfig(max_supported_total_tokens=16384)) as s:

        async def one(client: AsyncInferenceClient, i: int) -> str:
            tokens = [t async for t in await client.text_generation(f"req {i}", max_new_tokens=12, stream=True)]
            return "".join(tokens)

        async def main() -> list[str]:
            client = AsyncInferenceClient(base_url=s.base_url, timeout=60)
            return await asyncio.gather(*(one(client, i) for i in range(100)))

        started = time.monotonic()
        texts = asyncio.run(main())
        assert texts == ["abcdefghijkl"] * 100
        assert s.router.stats.requests_finished == 100
        assert s.router.stats.concurrency_peak > 1
        assert time.monotonic() - started < 60


def test_router_fatal_is_loud():
    def no_tokens(method, request, response):
        if method == "Decode":
            for generation in response.generations:
                generation.ClearField("tokens")
        return response

    with pytest.raises(RouterFatalError):
        with fake_http_stack() as s:
            s.shards[0].mutate = no_tokens
            client = InferenceClient(base_url=s.base_url)
            with pytest.raises(Exception) as info:
                client.text_generation("x", max_new_tokens=3)
            assert "generation_without_tokens" in str(info.value)  # the replay's fatal, as a 500 body
            url = urlparse(s.base_url)
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert response.status == 500 and json.loads(response.read())["error_type"] == "router_fatal"
