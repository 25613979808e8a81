"""Router replay against an in-test fake shard: startup sequence, limits, sharding, tokenizer loading."""

from __future__ import annotations

import asyncio

import pytest

from integration.router_replay import GenerateParameters, Router, RouterStartupError
from integration.router_replay.fake_shard import CharTokenizer, FakeShardConfig, fake_shards
from tgi_paged_backend.server.pb import generate_pb2 as pb

LIMITS = dict(max_input_tokens=200, max_total_tokens=256, max_batch_prefill_tokens=512)


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_startup_rpc_order_and_warmup_batch():
    async def body():
        async with fake_shards(FakeShardConfig(block_size=16)) as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            assert shard.methods() == ["ServiceDiscovery", "ClearCache", "Info", "Warmup"]
            assert not shard.calls[1][1].HasField("id")  # ClearCache(None)
            assert [m for m, _ in router.rpc_log] == ["ServiceDiscovery", "ClearCache", "Info", "Warmup"]
            warmup = shard.calls[3][1]
            assert warmup.max_input_tokens == 200 and warmup.max_total_tokens == 256
            assert warmup.max_prefill_tokens == 512
            reqs = warmup.batch.requests
            assert [r.truncate for r in reqs] == [200, 200, 112]
            assert all(r.id == 0 and not r.blocks and not r.slots for r in reqs)
            assert [c.WhichOneof("chunk") for c in reqs[0].input_chunks.chunks] == ["text", "image"]
            assert [r.stopping_parameters.max_new_tokens for r in reqs] == [56, 56, 144]
            info = router.info
            assert (info.max_batch_total_tokens, info.max_input_tokens, info.max_total_tokens) == (4096, 200, 256)
            assert info.num_blocks == 256 and info.block_size == 16 and router.free_blocks == 255
            assert info.shard_urls == (shard.socket_path,)
            await router.close()
            assert "Health" not in shard.methods()

    run(body())


def test_startup_without_user_limits_takes_the_shard_answer():
    async def body():
        config = FakeShardConfig(default_max_total_tokens=300, max_supported_total_tokens=1000)
        async with fake_shards(config) as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), max_batch_prefill_tokens=400)
            warmup = shard.calls[3][1]
            assert not warmup.HasField("max_input_tokens") and not warmup.HasField("max_total_tokens")
            assert len(warmup.batch.requests) == 1 and warmup.batch.requests[0].truncate == 400
            assert (router.info.max_input_tokens, router.info.max_total_tokens) == (299, 300)
            assert router.info.max_batch_total_tokens == 1000
            await router.close()

    run(body())


@pytest.mark.parametrize(
    "config, kwargs, message",
    [
        (FakeShardConfig(max_supported_total_tokens=100), {}, "Not enough memory"),
        (FakeShardConfig(), dict(max_batch_prefill_tokens=100), "max_batch_prefill_tokens` must be >="),
        (FakeShardConfig(support_chunking=True, max_supported_total_tokens=300), {}, "must be <= `max_batch_total"),
        (FakeShardConfig(block_size=0), {}, "block_size"),
    ],
)
def test_startup_validation_failures(config, kwargs, message):
    async def body():
        async with fake_shards(config) as (shard,):
            with pytest.raises(RouterStartupError, match=message.replace("`", ".")):
                await Router.connect(shard.uds_base_path, CharTokenizer(), **{**LIMITS, **kwargs})

    run(body())


def test_startup_assert_and_rpc_failures():
    async def body():
        async with fake_shards() as (shard,):
            # A shard that does not echo the requested limits makes the stock router panic.
            wrong = pb.WarmupResponse(max_supported_total_tokens=4096, max_input_tokens=7, max_total_tokens=256)
            shard.mutate = lambda method, request, response: wrong if method == "Warmup" else response
            with pytest.raises(RouterStartupError, match="assertion"):
                await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            shard.mutate = None
            shard.fail_next["Warmup"] = "out of memory"
            with pytest.raises(RouterStartupError, match="warmup the Python model shards: Server error: out of memory"):
                await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            shard.fail_next["ClearCache"] = "nope"
            with pytest.raises(RouterStartupError, match="Unable to clear the Python model shards cache"):
                await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            shard.fail_next["ServiceDiscovery"] = "no"
            with pytest.raises(RouterStartupError, match="Server does not support v3 interface"):
                await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            with pytest.raises(RouterStartupError, match="Unable to connect"):
                await Router.connect(shard.uds_base_path + "-missing", CharTokenizer(), **LIMITS)
            with pytest.raises(RouterStartupError, match="max_batch_size"):
                await Router.connect(shard.uds_base_path, CharTokenizer(), max_batch_size=0)

    run(body())


def test_two_shards_fan_out_and_merge():
    async def body():
        async with fake_shards(FakeShardConfig(block_size=4), world_size=2) as shards:
            shards[1].config = FakeShardConfig(block_size=4, max_supported_total_tokens=2048, attention_impl="last")
            router = await Router.connect(shards[0].uds_base_path, CharTokenizer(), **LIMITS)
            assert router.info.attention_impl == "last"  # Info: the last shard's answer
            assert router.info.max_batch_total_tokens == 2048  # Warmup: the minimum tuple
            assert shards[0].methods()[0] == "ServiceDiscovery" and "ServiceDiscovery" not in shards[1].methods()
            streams = [await router.generate(f"req {i}", GenerateParameters(max_new_tokens=3)) for i in range(3)]
            results = [await s.collect() for s in streams]
            assert [r[-1].generated_text for r in results] == ["abc"] * 3
            assert all(len(r) == 3 for r in results)  # each token once: exactly one rank emits it
            for shard in shards:
                startup = [m for m in shard.methods() if m != "ServiceDiscovery"][:3]
                assert startup == ["ClearCache", "Info", "Warmup"]
                assert "Prefill" in shard.methods() and "Decode" in shard.methods()
            assert [m for m, _ in router.rpc_log].count("Info") == 1
            await router.close()

    run(body())


def test_router_loads_tokenizer_from_model_dir(tmp_path):
    from helpers.tiny_tokenizer import make_tiny_tokenizer

    hf = make_tiny_tokenizer()
    hf.save_pretrained(tmp_path)
    text = "the quick brown fox"
    expected = hf(text)["input_ids"]

    async def body():
        async with fake_shards(tokenizer=hf) as (shard,):
            router = await Router.connect(shard.uds_base_path, str(tmp_path), **LIMITS)
            stream = await router.generate(text, GenerateParameters(max_new_tokens=2))
            assert stream.input_length == len(expected)
            await stream.collect()
            stream = await router.generate(text, GenerateParameters(max_new_tokens=2, truncate=3))
            assert stream.input_length == 3
            await stream.collect()
            prefills = [req for m, req in shard.calls if m == "Prefill"]
            first, second = prefills[0].batch.requests[0], prefills[-1].batch.requests[0]
            assert first.inputs == text and first.truncate == 200  # full text; truncate = max_input_tokens
            assert len(first.slots) == len(expected) + 2 - 1
            assert second.truncate == 3 and len(second.slots) == 3 + 2 - 1
            assert not shard.violations
            await router.close()

    run(body())
