"""The official TGI clients, unchanged, against the HTTP API over the router replay over a fake shard.

The fake shard's k-th generated token is ``"abc..."[k]``; with ``eos_after=6`` it ends with EOS after
six letters. Clients: ``text_generation.Client``/``AsyncClient`` (skipped when the ``text-generation``
package is absent: it pins ``huggingface-hub<1``, see pyproject's ``tgi-client`` extra) and
``huggingface_hub.InferenceClient``.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from huggingface_hub import InferenceClient

from integration.http_api.fake import fake_http_stack
from integration.router_replay.fake_shard import FakeShardConfig


@pytest.fixture(scope="module")
def stack():
    with fake_http_stack(FakeShardConfig(eos_after=6)) as s:
        yield s


@pytest.fixture()
def tg():
    return pytest.importorskip("text_generation")


def prefill_requests(stack):
    return [r for method, call in stack.shards[0].calls if method == "Prefill" for r in call.batch.requests]


# -- text_generation.Client ------------------------------------------------------------------------


def test_tg_generate_greedy_details(stack, tg):
    response = tg.Client(stack.base_url).generate("hello", max_new_tokens=4)
    assert response.generated_text == "abcd"
    details = response.details
    assert details.finish_reason == tg.types.FinishReason.Length
    assert details.generated_tokens == 4
    assert details.seed is None  # greedy: the shard reports no seed
    assert [t.text for t in details.tokens] == list("abcd")
    assert details.prefill == []


def test_tg_generate_eos_and_seed(stack, tg):
    response = tg.Client(stack.base_url).generate("hello", max_new_tokens=20, do_sample=True, seed=42)
    assert response.generated_text == "abcdef"
    assert response.details.finish_reason == tg.types.FinishReason.EndOfSequenceToken
    assert response.details.seed == 42
    assert response.details.tokens[-1].special is True


def test_tg_generate_stream(stack, tg):
    events = list(tg.Client(stack.base_url).generate_stream("hello", max_new_tokens=5))
    assert "".join(e.token.text for e in events) == "abcde"
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    assert events[-1].generated_text == "abcde"
    assert events[-1].details.generated_tokens == 5


def test_tg_stop_sequences_reach_the_shard(stack, tg):
    tg.Client(stack.base_url).generate("stop test", max_new_tokens=2, stop_sequences=["xyz", "\n\n"])
    request = [r for r in prefill_requests(stack) if r.inputs == "stop test"][-1]
    assert list(request.stopping_parameters.stop_sequences) == ["xyz", "\n\n"]
    assert request.add_special_tokens is True


def test_tg_decoder_input_details_and_top_n(stack, tg):
    response = tg.Client(stack.base_url).generate("hey", max_new_tokens=2, decoder_input_details=True, top_n_tokens=2)
    prefill = response.details.prefill
    assert [t.text for t in prefill] == ["<s>", "h", "e", "y"]
    assert prefill[0].logprob is None  # the shard's NaN is sent as null
    assert len(response.details.top_tokens) == 2 and len(response.details.top_tokens[0]) == 2


def test_tg_best_of(stack, tg):
    response = tg.Client(stack.base_url).generate("hey", max_new_tokens=3, best_of=2, do_sample=True)
    assert response.generated_text == "abc"
    assert len(response.details.best_of_sequences) == 1


def test_tg_validation_errors(stack, tg):
    client = tg.Client(stack.base_url)
    with pytest.raises(tg.errors.ValidationError, match="must be <= 1024"):
        client.generate("hello", max_new_tokens=1024)
    with pytest.raises(tg.errors.ValidationError, match="stop sequences"):
        client.generate("hello", stop_sequences=list("abcde"))
    with pytest.raises(tg.errors.ValidationError, match="top_n_tokens"):
        client.generate("hello", top_n_tokens=6)
    with pytest.raises(tg.errors.ValidationError, match="max_new_tokens"):
        list(client.generate_stream("hello", max_new_tokens=1024))


def test_tg_async_client(stack, tg):
    async def main():
        client = tg.AsyncClient(stack.base_url)
        response = await client.generate("hello", max_new_tokens=3)
        tokens = [e.token.text async for e in client.generate_stream("hello", max_new_tokens=3)]
        with pytest.raises(tg.errors.ValidationError):
            await client.generate("hello", max_new_tokens=1024)
        return response, tokens

    response, tokens = asyncio.run(main())
    assert response.generated_text == "abc"
    assert tokens == ["a", "b", "c"]


def test_tg_overloaded_and_generation_errors(tg):
    with fake_http_stack(router_kwargs={"max_concurrent_requests": 1}) as s:
        client = tg.Client(s.base_url)
        s.set_gate("Decode", open=False)  # the first request holds the only permit
        result = {}
        thread = threading.Thread(target=lambda: result.setdefault("r", client.generate("a", max_new_tokens=3)))
        thread.start()
        _wait_for(lambda: "Decode" in s.shards[0].methods())
        with pytest.raises(tg.errors.OverloadedError, match="Model is overloaded"):
            client.generate("b", max_new_tokens=3)
        s.set_gate("Decode", open=True)
        thread.join(10)
        assert result["r"].generated_text == "abc"

        s.shards[0].fail_next["Prefill"] = "CUDA out of memory (drill)"
        with pytest.raises(
            tg.errors.GenerationError, match="Request failed during generation: Server error: CUDA out of memory"
        ):
            client.generate("c", max_new_tokens=3)


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# -- huggingface_hub.InferenceClient ---------------------------------------------------------------


def test_hub_text_generation(stack):
    client = InferenceClient(base_url=stack.base_url)
    # Without return_full_text the compat route prepends the prompt, as stock does for a model whose
    # hub pipeline tag is unknown (a local directory); recent huggingface_hub releases omit the key.
    assert client.text_generation("hello", max_new_tokens=3, return_full_text=False) == "abc"
    assert client.text_generation("hello", max_new_tokens=3, return_full_text=True) == "helloabc"
    out = client.text_generation("hello", max_new_tokens=3, details=True, return_full_text=False)
    assert out.generated_text == "abc" and out.details.finish_reason == "length"
    assert [t.text for t in out.details.tokens] == ["a", "b", "c"]
    streamed = list(client.text_generation("hello", max_new_tokens=3, stream=True))
    assert streamed == ["a", "b", "c"]
    detailed = list(
        client.text_generation("hello", max_new_tokens=3, stream=True, details=True, return_full_text=False)
    )
    assert detailed[-1].generated_text == "abc" and detailed[-1].details.generated_tokens == 3


def test_hub_chat_completion(stack):
    client = InferenceClient(base_url=stack.base_url)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = client.chat_completion(messages, max_tokens=4)
    assert out.choices[0].message.content == "abcd"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 4
    assert out.usage.prompt_tokens == len("<system>be brief<user>hi<assistant>")  # no BOS for chat
    request = [r for r in prefill_requests(stack) if r.inputs.startswith("<system>be brief")][-1]
    assert request.add_special_tokens is False
    assert request.adapter_id == "dummy"  # what the client sends as "model"; the stock router forwards it
    eos = client.chat_completion(messages, max_tokens=20, model="tgi")
    assert eos.choices[0].message.content == "abcdef" and eos.choices[0].finish_reason == "stop"
    assert eos.model == "fake/model"


def test_hub_chat_completion_stream(stack):
    client = InferenceClient(base_url=stack.base_url)
    chunks = list(
        client.chat_completion(
            [{"role": "user", "content": "hi"}],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            model="tgi",
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "abcdef"  # the EOS token (special) streams as ""
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_hub_chat_completion_logprobs(stack):
    client = InferenceClient(base_url=stack.base_url)
    out = client.chat_completion(
        [{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, top_logprobs=1, model="tgi"
    )
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == ["a", "b"] and content[0].logprob == -0.5


def test_hub_info_and_health(stack):
    client = InferenceClient(model=stack.base_url, provider="hf-inference")  # these two calls need it
    info = client.get_endpoint_info()
    assert info["model_id"] == "fake/model" and info["max_total_tokens"] == 1024
    assert client.health_check()
