"""Router replay batching loop against a fake shard: FilterBatch/ClearCache, frees, chunking, legs, errors."""

from __future__ import annotations

import asyncio
import gc

import pytest

from integration.router_replay import (
    GenerateParameters,
    GenerationError,
    IncompleteGenerationError,
    OverloadedError,
    PrefillEvent,
    Router,
    ValidationError,
)
from integration.router_replay.fake_shard import CharTokenizer, FakeShardConfig, fake_shards

LIMITS = dict(max_input_tokens=200, max_total_tokens=256, max_batch_prefill_tokens=512)
LEG_LIMITS = dict(max_input_tokens=1099, max_total_tokens=1100, max_batch_prefill_tokens=2048)
U64_MAX = 2**64 - 1


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def calls(shard, method):
    return [req for m, req in shard.calls if m == method]


def runtime(shard):
    return shard.methods()[4:]


async def wait_until(predicate, timeout=5.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_filter_batch_after_early_finish_and_blocks_freed_before_it():
    async def body():
        async with fake_shards(FakeShardConfig(block_size=16)) as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            gate = shard.pause["Prefill"] = asyncio.Event()
            warm = await router.generate("w" * 9, GenerateParameters(max_new_tokens=1))
            await wait_until(lambda: calls(shard, "Prefill"))  # in flight, held by the gate
            short = await router.generate("x" * 9, GenerateParameters(max_new_tokens=1))
            long = await router.generate("y" * 9, GenerateParameters(max_new_tokens=40))
            del shard.pause["Prefill"]
            gate.set()
            assert (await warm.collect())[-1].generated_tokens == 1
            assert (await short.collect())[-1].generated_text == "a"
            late = await router.generate("z" * 9, GenerateParameters(max_new_tokens=2))
            await late.collect()
            await long.collect()
            prefills = calls(shard, "Prefill")
            # 10 prompt tokens (BOS + 9) + 1 - 1 -> 10 slots in the tail block 255.
            first = prefills[0].batch.requests[0]
            assert list(first.blocks) == [255] and list(first.slots) == list(range(255 * 16, 255 * 16 + 10))
            assert [r.id for r in prefills[1].batch.requests] == [1, 2]
            blocks = {r.id: list(r.blocks) for p in prefills for r in p.batch.requests}
            # Block 255 is freed at each final generation and handed out again at once (LIFO).
            assert blocks == {0: [255], 1: [255], 2: [251, 252, 253, 254], 3: [255]}
            # Request 1 finished inside batch 1 -> FilterBatch keeps only request 2, after the free.
            assert [(f.batch_id, list(f.request_ids)) for f in calls(shard, "FilterBatch")][0] == (1, [2])
            assert router.free_blocks == 255 and not shard.violations
            stats = router.stats
            assert stats.filter_batch_calls == len(calls(shard, "FilterBatch")) and stats.requests_finished == 4
            await router.close()

    run(body())


def test_cancel_triggers_filter_then_clear_cache():
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            keep = await router.generate("keep", GenerateParameters(max_new_tokens=200))
            drop = await router.generate("drop", GenerateParameters(max_new_tokens=200))
            await drop.__anext__()
            await drop.aclose()  # client disconnect
            await wait_until(lambda: calls(shard, "FilterBatch"))
            kept_ids = [list(f.request_ids) for f in calls(shard, "FilterBatch")]
            assert kept_ids[-1] == [keep.request_ids[0]]
            await keep.__anext__()
            del keep  # dropping the iterator is a disconnect too
            gc.collect()
            await wait_until(lambda: any(req.HasField("id") for req in calls(shard, "ClearCache")))
            cleared = [req.id for req in calls(shard, "ClearCache") if req.HasField("id")]
            assert len(cleared) == 1 and router.stats.clear_cache_calls == 1
            await wait_until(lambda: router.free_blocks == router.info.num_blocks - 1)
            assert router.stats.requests_dropped == 2
            await router.close()

    run(body())


@pytest.mark.parametrize("max_waiting_tokens, reason", [(20, "backpressure"), (1, "wait_exceeded")])
def test_non_chunking_prefills_new_batch_alone_then_decodes_both(max_waiting_tokens, reason):
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(
                shard.uds_base_path, CharTokenizer(), **LIMITS, max_waiting_tokens=max_waiting_tokens
            )
            gate = shard.pause["Decode"] = asyncio.Event()
            a = await router.generate("first", GenerateParameters(max_new_tokens=30))
            await a.__anext__()
            await wait_until(lambda: calls(shard, "Decode"))
            b = await router.generate("second", GenerateParameters(max_new_tokens=2))
            del shard.pause["Decode"]
            gate.set()
            await b.collect()
            await a.collect()
            prefills = calls(shard, "Prefill")
            assert len(prefills) == 2 and not prefills[1].HasField("cached_batch")
            assert [r.id for r in prefills[1].batch.requests] == [1]
            two = [d for d in calls(shard, "Decode") if len(d.batches) == 2]
            assert two and [c.id for c in two[0].batches] == [0, 1]
            assert router.stats.batch_concat == {reason: 1}
            await router.close()

    run(body())


def test_chunking_sets_chunk_len_and_prefills_with_cached_batch():
    async def body():
        config = FakeShardConfig(block_size=1, support_chunking=True)
        async with fake_shards(config) as (shard,):
            router = await Router.connect(
                shard.uds_base_path, CharTokenizer(), **{**LIMITS, "max_batch_prefill_tokens": 64}
            )
            big = await router.generate("b" * 150, GenerateParameters(max_new_tokens=3))
            small = await router.generate("s" * 10, GenerateParameters(max_new_tokens=3))
            assert (await big.collect())[-1].generated_tokens == 3
            await small.collect()
            first = calls(shard, "Prefill")[0]
            assert first.batch.requests[0].chunk_len == 64 and not first.HasField("cached_batch")
            merged = [p for p in calls(shard, "Prefill") if p.HasField("cached_batch")]
            assert merged, "new work joins a running batch through Prefill(cached_batch)"
            assert all(p.cached_batch.id == 0 for p in merged)
            assert router.stats.batch_concat.get("chunking", 0) == len(merged)
            assert not shard.violations
            await router.close()

    run(body())


def test_missing_generation_is_tolerated():
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            gate = shard.pause["Decode"] = asyncio.Event()
            stream = await router.generate("wait", GenerateParameters(max_new_tokens=3))
            await stream.__anext__()
            shard.hold[stream.request_ids[0]] = 5  # kept in the batch, no Generation for 5 steps
            del shard.pause["Decode"]
            gate.set()
            events = await stream.collect()
            assert events[-1].generated_text == "abc" and events[-1].generated_tokens == 3
            assert len(calls(shard, "Decode")) == 7
            assert router.fatal_error is None
            await router.close()

    run(body())


def test_leg_cap_continues_under_a_new_request_id():
    async def body():
        async with fake_shards(FakeShardConfig(max_supported_total_tokens=8192)) as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LEG_LIMITS)
            prompt = "p" * 9  # 10 tokens with BOS; no max_new_tokens -> 1090 in total
            stream = await router.generate(prompt, GenerateParameters())
            events = await stream.collect()
            final = events[-1]
            assert final.generated_tokens == 1090 and final.finish_reason == "length"
            assert len(events) == 1090 and len(stream.request_ids) == 2
            legs = [p.batch.requests[0] for p in calls(shard, "Prefill")]
            assert legs[0].stopping_parameters.max_new_tokens == 1024
            assert legs[1].id == stream.request_ids[1] != legs[0].id
            assert legs[1].inputs == prompt + final.generated_text[:1024]
            assert legs[1].stopping_parameters.max_new_tokens == 66
            assert legs[1].parameters.seed == legs[0].parameters.seed
            assert final.generated_text == events[-1].generated_text and len(final.generated_text) == 1090
            assert router.stats.continuation_legs == 1
            await router.close()

    run(body(), timeout=40)


def test_leg_revalidation_failure_returns_accumulated_result():
    async def body():
        async with fake_shards(FakeShardConfig(max_supported_total_tokens=8192)) as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LEG_LIMITS)
            stream = await router.generate("q" * 9, GenerateParameters(max_new_tokens=1100))
            final = (await stream.collect())[-1]
            assert final.generated_tokens == 1024 and len(stream.request_ids) == 1
            await router.close()

    run(body(), timeout=40)


def test_prefill_error_clears_batch_and_health_uses_liveness_probe():
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            assert await router.health() and runtime(shard) == ["Health"]
            shard.fail_next["Prefill"] = "boom"
            stream = await router.generate("x", GenerateParameters(max_new_tokens=2))
            with pytest.raises(GenerationError, match="^Request failed during generation: Server error: boom$"):
                await stream.collect()
            assert runtime(shard)[1:] == ["Prefill", "ClearCache"]
            assert calls(shard, "ClearCache")[-1].id == 0
            assert not router.backend_healthy
            assert await router.health()
            probe = calls(shard, "Prefill")[-1]
            assert probe.batch.id == U64_MAX and probe.batch.requests[0].id == U64_MAX
            assert list(probe.batch.requests[0].blocks) == [0] and list(probe.batch.requests[0].slots) == [0]
            assert runtime(shard)[-1] == "Prefill" and router.backend_healthy
            assert await router.health() and runtime(shard)[-1] == "Health"
            # The router keeps working after a failed batch.
            ok = await router.generate("y", GenerateParameters(max_new_tokens=2, decoder_input_details=True))
            events = await ok.collect()
            assert isinstance(events[0], PrefillEvent) and events[-1].prefill == events[0].tokens
            await router.close()

    run(body())


def test_decode_error_clears_every_batch_sent():
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS, max_waiting_tokens=1)
            a = await router.generate("a", GenerateParameters(max_new_tokens=50))
            await a.__anext__()
            b = await router.generate("b", GenerateParameters(max_new_tokens=50))
            await b.__anext__()
            shard.fail_next["Decode"] = "decode broke"
            for stream in (a, b):
                with pytest.raises(GenerationError, match="decode broke"):
                    await stream.collect()
            failed = [d for d in calls(shard, "Decode")][-1]
            cleared = [req.id for req in calls(shard, "ClearCache") if req.HasField("id")]
            assert cleared == [c.id for c in failed.batches]
            assert router.stats.decode_failures == 1 and router.free_blocks == router.info.num_blocks - 1
            await router.close()

    run(body())


def test_validation_overload_and_seed():
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS, max_concurrent_requests=1)
            with pytest.raises(ValidationError, match="`top_p` must be > 0.0 and < 1.0"):
                await router.generate("x", GenerateParameters(top_p=1.0))
            with pytest.raises(ValidationError, match="must be <= 256. Given: 251 `inputs` tokens and 10"):
                await router.generate("x" * 250, GenerateParameters(max_new_tokens=10))
            first = await router.generate("x", GenerateParameters(max_new_tokens=2, do_sample=True))
            with pytest.raises(OverloadedError):
                await router.generate("x", GenerateParameters(max_new_tokens=2))
            final = (await first.collect())[-1]
            sent = calls(shard, "Prefill")[-1].batch.requests[0].parameters.seed
            assert final.seed == sent and 0 <= sent < 2**64
            again = await router.generate("x", GenerateParameters(max_new_tokens=2, seed=7, top_n_tokens=2))
            events = await again.collect()
            assert calls(shard, "Prefill")[-1].batch.requests[0].parameters.seed == 7
            assert all(len(e.top_tokens) == 2 for e in events) and events[-1].seed is None
            await router.close()

    run(body())


def test_lenient_mode_vanished_request_is_incomplete():
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS, strict=False)
            stream = await router.generate("gone", GenerateParameters(max_new_tokens=5))

            def vanish(method, request, response):
                if method == "Prefill":
                    response.ClearField("batch")
                    del response.generations[:]
                return response

            shard.mutate = vanish
            with pytest.raises(IncompleteGenerationError):
                await stream.collect()
            assert router.stats.requests_incomplete == 1 and router.fatal_error is None
            await router.close()

    run(body())


def test_prefix_caching_reuses_finished_prompt_blocks():
    async def body():
        async with fake_shards(FakeShardConfig(block_size=4, use_prefix_caching=True)) as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            assert router.info.use_prefix_caching
            prompt = "c" * 10  # 11 tokens with BOS: 2 full blocks are cached after the first request
            for _ in range(2):
                await (await router.generate(prompt, GenerateParameters(max_new_tokens=2))).collect()
            await (await router.generate("c" * 7, GenerateParameters(max_new_tokens=2))).collect()  # 8 tokens
            first, second, third = (p.batch.requests[0] for p in calls(shard, "Prefill"))
            assert first.cache_len == 0 and second.cache_len == 8
            assert list(second.blocks[:2]) == list(first.blocks[:2])
            assert third.cache_len == 7  # a full-prompt hit still computes one token
            assert second.slots[:8] == first.slots[:8] and not shard.violations
            assert calls(shard, "Prefill")[1].batch.max_tokens == 3
            await router.close()

    run(body())
