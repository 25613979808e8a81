"""Every generate.v3 RPC through the real grpc.aio server and the generated client stub, on a fake engine."""

from __future__ import annotations

import math
import os
import threading
import time

import grpc
import pytest
from server_fakes import FakeEngine, InProcessShard, make_config

from tgi_paged_backend.engine.types import GrammarSpec, ImageInput, RequestSpec, SamplingParams, StoppingParams
from tgi_paged_backend.server.pb import generate_pb2 as pb
from tgi_paged_backend.server.pb import generate_pb2_grpc as pb_grpc

U64_MAX = 2**64 - 1


def text_request(request_id: int, text: str, *, max_new_tokens: int = 2, **fields) -> pb.Request:
    return pb.Request(
        id=request_id,
        inputs=text,
        input_chunks=pb.Input(chunks=[pb.InputChunk(text=text)]),
        truncate=64,
        parameters=pb.NextTokenChooserParameters(
            temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0, seed=7
        ),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new_tokens),
        slots=list(range(16, 16 + 8)),
        blocks=[1],
        **fields,
    )


def prefill(stub, batch_id: int, *requests: pb.Request, cached: int | None = None, **kw) -> pb.PrefillResponse:
    message = pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=requests, size=len(requests)))
    if cached is not None:
        message.cached_batch.CopyFrom(pb.CachedBatch(id=cached))
    return stub.Prefill(message, **kw)


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# -- Info / ServiceDiscovery / Health / ClearCache / Warmup --------------------------------------


def test_info_fields_and_unset_window_size(stub, engine: FakeEngine) -> None:
    info = stub.Info(pb.InfoRequest())
    assert (info.requires_padding, info.dtype, info.device_type, info.speculate) == (False, "torch.float32", "cpu", 0)
    assert (info.support_chunking, info.use_prefix_caching, info.attention_impl, info.block_size) == (
        True,
        True,
        "paged",
        16,
    )
    assert not info.HasField("window_size")
    engine.window_size = 4096
    assert stub.Info(pb.InfoRequest()).window_size == 4096


def test_service_discovery_lists_every_rank_in_order(short_dir, monkeypatch) -> None:
    monkeypatch.chdir(short_dir)  # a relative --uds-path must still give absolute URLs
    config = make_config("rel/sock", rank=1, world_size=3)
    (short_dir / "rel").mkdir()
    shard = InProcessShard(config, FakeEngine()).start()
    try:
        assert shard.socket_path == f"{short_dir}/rel/sock-1"
        with grpc.insecure_channel(f"unix://{shard.socket_path}") as channel:
            urls = pb_grpc.TextGenerationServiceStub(channel).ServiceDiscovery(pb.ServiceDiscoveryRequest()).urls
        assert list(urls) == [f"unix://{short_dir}/rel/sock-{rank}" for rank in range(3)]
    finally:
        assert shard.stop() == 0
    assert not os.path.exists(shard.socket_path)


def test_health_maps_engine_failure_to_internal_and_recovers(stub, engine: FakeEngine) -> None:
    stub.Health(pb.HealthRequest())
    engine.broken = True
    assert status_of(lambda: stub.Health(pb.HealthRequest())) == (grpc.StatusCode.INTERNAL, "device is broken")
    engine.broken = False
    stub.Health(pb.HealthRequest())
    assert len(engine.calls_named("health")) == 3


def test_clear_cache_optional_u64_id(stub, engine: FakeEngine) -> None:
    stub.ClearCache(pb.ClearCacheRequest())
    stub.ClearCache(pb.ClearCacheRequest(id=U64_MAX))
    stub.ClearCache(pb.ClearCacheRequest(id=0))
    assert engine.calls_named("clear_cache") == [None, U64_MAX, 0]


def test_warmup_optional_limits(stub, engine: FakeEngine) -> None:
    batch = pb.Batch(id=0, requests=[text_request(0, "warm", max_new_tokens=1)], size=1)
    answer = stub.Warmup(pb.WarmupRequest(batch=batch, max_prefill_tokens=4096))
    assert answer.HasField("max_supported_total_tokens")
    assert (answer.max_supported_total_tokens, answer.max_input_tokens, answer.max_total_tokens) == (
        100_000,
        4095,
        4096,
    )
    answer = stub.Warmup(
        pb.WarmupRequest(batch=batch, max_prefill_tokens=512, max_input_tokens=100, max_total_tokens=200)
    )
    assert (answer.max_input_tokens, answer.max_total_tokens) == (100, 200)
    first, second = engine.calls_named("warmup")
    assert (first["max_input_tokens"], first["max_prefill_tokens"], first["max_total_tokens"]) == (None, 4096, None)
    assert (second["max_input_tokens"], second["max_prefill_tokens"], second["max_total_tokens"]) == (100, 512, 200)
    assert first["batch"].requests[0].text == "warm"


def test_large_warmup_message_is_accepted(stub) -> None:
    big = "x" * (6 * 1024 * 1024)  # above grpc's 4 MiB default receive limit
    batch = pb.Batch(id=0, requests=[text_request(0, big, max_new_tokens=1)], size=1)
    assert stub.Warmup(pb.WarmupRequest(batch=batch, max_prefill_tokens=1)).max_total_tokens == 4096


# -- Prefill: inbound conversion --------------------------------------------------------------


def test_prefill_converts_every_request_field(stub, engine: FakeEngine) -> None:
    full = pb.Request(
        id=U64_MAX,
        inputs="ignored when chunks are present",
        input_chunks=pb.Input(
            chunks=[
                pb.InputChunk(image=pb.Image(data=b"\x89PNG", mimetype="image/png")),
                pb.InputChunk(text="Hello world"),
            ]
        ),
        truncate=1000,
        parameters=pb.NextTokenChooserParameters(
            temperature=0.5,
            top_k=40,
            top_p=0.75,
            typical_p=0.25,
            do_sample=True,
            seed=2**64 - 2,
            repetition_penalty=1.5,
            frequency_penalty=0.125,
            watermark=True,
        ),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=3, stop_sequences=["\n\n", "###"], ignore_eos_token=True
        ),
        prefill_logprobs=True,
        top_n_tokens=5,
        blocks=[3, 4],
        slots=[48, 49, 50, 64],
        cache_len=16,
        add_special_tokens=True,
        chunk_len=0,  # set to zero is not the same as unset
    )
    legacy = pb.Request(
        id=5, inputs="from inputs", truncate=8, stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1)
    )
    stub.Prefill(
        pb.PrefillRequest(batch=pb.Batch(id=U64_MAX, requests=[full, legacy], size=2, max_tokens=77, max_blocks=2))
    )

    (call,) = engine.calls_named("prefill")
    assert call["cached_batch_id"] is None
    batch = call["batch"]
    assert (batch.id, batch.max_tokens, batch.max_blocks) == (U64_MAX, 77, 2)
    assert batch.requests[0] == RequestSpec(
        id=U64_MAX,
        text="Hello world",
        truncate=1000,
        add_special_tokens=True,
        sampling=SamplingParams(
            temperature=0.5,
            top_k=40,
            top_p=0.75,
            typical_p=0.25,
            do_sample=True,
            seed=2**64 - 2,
            repetition_penalty=1.5,
            frequency_penalty=0.125,
            watermark=True,
        ),
        stopping=StoppingParams(max_new_tokens=3, stop_sequences=("\n\n", "###"), ignore_eos_token=True),
        prefill_logprobs=True,
        top_n_tokens=5,
        blocks=(3, 4),
        slots=(48, 49, 50, 64),
        cache_len=16,
        chunk_len=0,
        chunks=(ImageInput(b"\x89PNG", "image/png"), "Hello world"),
    )
    assert batch.requests[1] == RequestSpec(
        id=5,
        text="from inputs",
        truncate=8,
        add_special_tokens=False,
        sampling=SamplingParams(temperature=0.0, top_p=0.0, typical_p=0.0, repetition_penalty=0.0),
        stopping=StoppingParams(max_new_tokens=1),
        chunk_len=None,
    )


@pytest.mark.parametrize(
    "chunks, expected",
    [
        ([pb.InputChunk(image=pb.Image(data=b"x", mimetype="image/png"))], "got 0"),
        ([pb.InputChunk(text="a"), pb.InputChunk(text="b")], "got 2"),
    ],
)
def test_zero_or_two_text_chunks_are_invalid_and_server_keeps_serving(stub, engine, chunks, expected) -> None:
    bad = pb.Request(
        id=42,
        inputs="ab",
        input_chunks=pb.Input(chunks=chunks),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1),
    )
    code, details = status_of(lambda: prefill(stub, 1, bad))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 42" in details and "exactly one text chunk" in details and expected in details
    assert engine.calls_named("prefill") == []  # rejected before the engine saw it
    assert prefill(stub, 2, text_request(1, "fine", max_new_tokens=1)).generations[0].request_id == 1


def test_grammars_reach_the_engine_as_regex_or_json(stub, engine) -> None:
    regex, schema = text_request(1, "digits"), text_request(2, "json please")
    regex.parameters.grammar, regex.parameters.grammar_type = "[0-9]+", pb.GRAMMAR_TYPE_REGEX
    schema.parameters.grammar, schema.parameters.grammar_type = '{"type": "integer"}', pb.GRAMMAR_TYPE_JSON
    prefill(stub, 1, regex, schema, text_request(3, "free"))
    (call,) = engine.calls_named("prefill")
    grammars = [r.sampling.grammar for r in call["batch"].requests]
    assert grammars == [GrammarSpec("regex", "[0-9]+"), GrammarSpec("json", '{"type": "integer"}'), None]


@pytest.mark.parametrize("text, kind", [("[a-z]+", pb.GRAMMAR_TYPE_NONE), ("", pb.GRAMMAR_TYPE_REGEX)])
def test_grammar_text_and_type_that_disagree_fail_the_prefill_and_free_its_cached_batch(
    stub, engine, text, kind
) -> None:
    prefill(stub, 1, text_request(1, "running", max_new_tokens=3))
    bad = text_request(2, "json please")
    bad.parameters.grammar, bad.parameters.grammar_type = text, kind
    code, details = status_of(lambda: prefill(stub, 2, bad, cached=1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "request 2: grammar" in details
    # The router fails the cached batch's requests too (chunking): the shard lets them go.
    assert engine.calls_named("release_batches") == [[1]] and 1 not in engine.batches
    assert prefill(stub, 3, text_request(3, "fine", max_new_tokens=1)).generations


def test_an_adapter_id_is_served(stub) -> None:
    # Without that adapter loaded, stock serves it with the base model; the engine decides (see below).
    assert prefill(stub, 2, text_request(2, "lora", adapter_id="my-adapter", max_new_tokens=1)).generations


def test_the_adapter_id_reaches_the_engine_as_given() -> None:
    """``Request.adapter_id`` (field 11) reaches the engine unchanged; the engine maps names it did not load
    (and "") to the base model, as stock (tests/engine/test_shard_engine_lora.py)."""
    from tgi_paged_backend.server.convert import request_from_pb

    assert request_from_pb(text_request(3, "p", max_new_tokens=2, adapter_id="org/unknown")).adapter_id == "org/unknown"
    assert request_from_pb(text_request(3, "p", max_new_tokens=2)).adapter_id == ""


# -- Prefill / Decode: outbound conversion ----------------------------------------------------


def test_prefill_response_fields(stub) -> None:
    greedy_done = text_request(U64_MAX, "greedy", max_new_tokens=1, prefill_logprobs=True)
    sampled_done = text_request(9, "sampled", max_new_tokens=1)
    sampled_done.parameters.do_sample = True
    sampled_done.parameters.seed = 2**64 - 3
    running = text_request(10, "running", max_new_tokens=3, top_n_tokens=2)
    answer = prefill(stub, 3, greedy_done, sampled_done, running)

    by_id = {g.request_id: g for g in answer.generations}
    assert set(by_id) == {U64_MAX, 9, 10}
    greedy, sampled, live = by_id[U64_MAX], by_id[9], by_id[10]

    assert list(greedy.tokens.ids) == [101] and list(greedy.tokens.texts) == ["t1"]
    assert list(greedy.tokens.logprobs) == [-0.5] and list(greedy.tokens.is_special) == [False]
    assert greedy.HasField("prefill_tokens")
    assert math.isnan(greedy.prefill_tokens.logprobs[0]) and greedy.prefill_tokens.logprobs[1] == -1.25
    assert list(greedy.prefill_tokens.is_special) == []
    assert greedy.HasField("generated_text")
    assert greedy.generated_text.finish_reason == pb.FINISH_REASON_EOS_TOKEN
    assert (greedy.generated_text.text, greedy.generated_text.generated_tokens) == (f"out{U64_MAX}", 1)
    assert not greedy.generated_text.HasField("seed")

    assert sampled.generated_text.finish_reason == pb.FINISH_REASON_LENGTH
    assert sampled.generated_text.HasField("seed") and sampled.generated_text.seed == 2**64 - 3
    assert not sampled.HasField("prefill_tokens")
    assert len(sampled.top_tokens) == 0

    assert not live.HasField("generated_text")
    assert len(live.top_tokens) == 1 and list(live.top_tokens[0].is_special) == [False, True]

    assert answer.HasField("batch")
    assert (answer.batch.id, list(answer.batch.request_ids), answer.batch.size) == (3, [U64_MAX, 9, 10], 3)
    assert (answer.batch.max_tokens, answer.batch.current_tokens) == (24, 3)
    assert (answer.forward_ns, answer.decode_ns) == (11, 22)
    assert answer.total_ns > 0  # the fake reports 0: the servicer fills in the handler time
    assert not answer.HasField("concat_ns")


def test_prefill_batch_unset_when_all_finished(stub) -> None:
    answer = prefill(stub, U64_MAX, text_request(U64_MAX, "liveness", max_new_tokens=1))
    assert not answer.HasField("batch")
    assert answer.generations[0].generated_text.generated_tokens == 1


def test_prefill_with_cached_batch_merges_and_reports_concat(stub, engine) -> None:
    prefill(stub, 0, text_request(0, "old", max_new_tokens=5))
    answer = prefill(stub, 1, text_request(1, "new", max_new_tokens=5), cached=0)
    assert engine.calls_named("prefill")[1]["cached_batch_id"] == 0
    assert answer.HasField("concat_ns") and answer.concat_ns == 1234
    assert (answer.batch.id, list(answer.batch.request_ids)) == (0, [0, 1])
    code, details = status_of(lambda: prefill(stub, 2, text_request(2, "x"), cached=99))
    assert code == grpc.StatusCode.NOT_FOUND and details == "Batch ID 99 not found in cache."


def test_decode_merges_batches_and_maps_missing_batch(stub, engine) -> None:
    prefill(stub, 1, text_request(1, "a", max_new_tokens=2))
    prefill(stub, 2, text_request(2, "b", max_new_tokens=4))
    answer = stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=1), pb.CachedBatch(id=2)]))
    assert engine.calls_named("decode") == [[1, 2]]
    by_id = {g.request_id: g for g in answer.generations}
    assert by_id[1].generated_text.generated_tokens == 2 and not by_id[2].HasField("generated_text")
    assert (answer.batch.id, list(answer.batch.request_ids), answer.batch.size) == (1, [1, 2], 2)

    code, details = status_of(lambda: stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=7)])))
    assert code == grpc.StatusCode.NOT_FOUND and "7" in details
    code, _ = status_of(lambda: stub.Decode(pb.DecodeRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=1)])).batch.id == 1  # still serving


def test_filter_batch(stub, engine) -> None:
    prefill(stub, 4, text_request(U64_MAX - 1, "a", max_new_tokens=3), text_request(8, "b", max_new_tokens=3))
    kept = stub.FilterBatch(pb.FilterBatchRequest(batch_id=4, request_ids=[U64_MAX - 1])).batch
    assert (kept.id, list(kept.request_ids), kept.size, kept.current_tokens) == (4, [U64_MAX - 1], 1, 1)
    assert engine.calls_named("filter_batch") == [(4, [U64_MAX - 1])]
    code, _ = status_of(lambda: stub.FilterBatch(pb.FilterBatchRequest(batch_id=5, request_ids=[1])))
    assert code == grpc.StatusCode.NOT_FOUND


def test_huge_max_tokens_is_clamped_to_u32(stub, engine) -> None:
    engine.max_tokens_override = 2**40
    assert prefill(stub, 1, text_request(1, "a")).batch.max_tokens == 2**32 - 1


# -- errors and serialisation -----------------------------------------------------------------


def test_engine_errors_map_to_status_and_server_keeps_running(stub) -> None:
    code, details = status_of(lambda: prefill(stub, 1, text_request(1, "raise:internal")))
    assert (code, details) == (grpc.StatusCode.INTERNAL, "boom: the device caught fire")
    code, details = status_of(lambda: prefill(stub, 2, text_request(2, "raise:invalid")))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt is longer than the reserved slots")
    code, details = status_of(lambda: prefill(stub, 3, text_request(3, "bad:is_special")))
    assert code == grpc.StatusCode.INTERNAL and "is_special" in details
    stub.Health(pb.HealthRequest())
    assert prefill(stub, 4, text_request(4, "ok")).batch.id == 4


def test_rpcs_are_serialised_but_the_loop_stays_responsive(stub, engine) -> None:
    slow = threading.Thread(target=lambda: prefill(stub, 1, text_request(1, "sleep:1.0")))
    slow.start()
    while not engine.calls_named("prefill"):
        time.sleep(0.005)
    started = time.monotonic()
    stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())  # no engine call: answered at once
    assert time.monotonic() - started < 0.5
    others = [
        threading.Thread(target=lambda i=i: prefill(stub, 10 + i, text_request(10 + i, "sleep:0.05"))) for i in range(3)
    ]
    for t in others:
        t.start()
    stub.Health(pb.HealthRequest())  # queues behind the slow prefill
    assert time.monotonic() - started > 0.7
    for t in [slow, *others]:
        t.join()
    assert engine.max_active == 1


def test_cancelled_rpc_still_blocks_the_next_engine_call(stub, engine) -> None:
    code, _ = status_of(lambda: prefill(stub, 1, text_request(1, "sleep:0.5"), timeout=0.1))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    prefill(stub, 2, text_request(2, "sleep:0.05"))
    assert engine.max_active == 1


def test_stop_removes_socket_and_closes_engine(short_dir) -> None:
    engine = FakeEngine()
    shard = InProcessShard(make_config(str(short_dir / "s")), engine).start()
    assert os.path.exists(shard.socket_path)
    assert shard.stop() == 0
    assert not os.path.exists(shard.socket_path)
    assert engine.closed


def test_servicer_serialises_on_a_shared_thread_pool_even_after_cancellation() -> None:
    """Without the dedicated engine thread (executor=None) the servicer's own locks must serialise."""
    import asyncio

    from tgi_paged_backend.server.servicer import TextGenerationService

    engine = FakeEngine()
    servicer = TextGenerationService(engine, ["unix:///x-0"], executor=None)

    def call(batch_id: int, text: str):
        request = pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=[text_request(batch_id, text)]))
        return servicer.Prefill(request, context=None)

    async def main() -> None:
        await asyncio.gather(*(call(i, "sleep:0.05") for i in range(4)))
        cancelled = asyncio.ensure_future(call(10, "sleep:0.3"))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        await call(11, "sleep:0.05")  # must wait for the cancelled call's engine work to finish

    asyncio.run(main())
    assert engine.max_active == 1
    assert len(engine.calls_named("prefill")) == 6
