"""Router replay at block size 1 (stock TGI's flashinfer layout), taken from the shard's ``Info``.

At block size 1 the router's allocators hand out one virtual block per token, every slot is its
block id, and a radix prefix hit covers every prompt token but the last. Checked against the fake
shard (exact ids), then end to end against the real shard engine served in-process: the shard
answers ``Info.block_size == 1``, maps those per-token router slots onto its small physical pool
(preempting), and the greedy output is token-identical to HF transformers.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from integration.router_replay import GenerateParameters, Router
from integration.router_replay.fake_shard import CharTokenizer, FakeShardConfig, fake_shards
from tests.helpers.shard_driving import hf_greedy, run_requests
from tests.helpers.tiny_models import write_tiny_model
from tests.server.server_fakes import InProcessShard
from tgi_paged_backend.engine import build_engine
from tgi_paged_backend.envs import build_config

LIMITS = dict(max_input_tokens=200, max_total_tokens=256, max_batch_prefill_tokens=512)


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def prefill_requests(calls):
    return [r for method, req in calls if method == "Prefill" for r in req.batch.requests]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["simple", "radix"])
def test_fake_shard_block_size_one_allocates_a_block_per_token(prefix_caching):
    async def body():
        config = FakeShardConfig(block_size=1, use_prefix_caching=prefix_caching)
        async with fake_shards(config) as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            info = router.info
            assert info.block_size == 1 and info.num_blocks == info.max_batch_total_tokens == 4096
            assert router.free_blocks == 4095  # block 0 is the liveness probe's
            prompt = "x" * 9  # BOS + 9 = 10 prompt tokens
            for _ in range(2):
                stream = await router.generate(prompt, GenerateParameters(max_new_tokens=4))
                assert (await stream.collect())[-1].generated_tokens == 4
            first, second = prefill_requests(shard.calls)
            # 10 + 4 - 1 = 13 slots, one block each; slot == block id (block * 1 + offset 0).
            assert len(first.blocks) == len(first.slots) == 13
            assert list(first.slots) == list(first.blocks) and 0 not in first.blocks
            if prefix_caching:
                assert first.cache_len == 0
                # The whole prompt is cached; the router keeps the last token to compute.
                assert second.cache_len == 9
                assert list(second.blocks[:9]) == list(first.blocks[:9])
            else:
                assert list(first.blocks) == list(range(4083, 4096))  # the free list's tail
                assert list(second.blocks) == list(first.blocks)  # LIFO reuse after the free
                assert second.cache_len == 0
            assert list(second.slots) == list(second.blocks)
            assert not shard.violations
            await router.close()

    run(body())


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model("llama", tmp_path_factory.mktemp("bs1-llama"), seed=3)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_real_shard_block_size_one_router_replay_greedy_with_preemption(tiny_llama, tmp_path, preemption):
    # 64 physical tokens in 64 one-token blocks (+ scratch), 4x overcommit: the router admits six
    # ~25-token requests (~150 tokens) at once from its 256-block virtual pool, the shard preempts.
    config = build_config(
        {"model_id": str(tiny_llama), "uds_path": str(tmp_path / "shard")},
        {"TGI_PAGED_NUM_BLOCKS": "65", "TGI_PAGED_BLOCK_SIZE": "1", "TGI_PAGED_OVERCOMMIT": "4",
         "TGI_PAGED_PREEMPTION": preemption, "TGI_PAGED_SWAP_SPACE_GB": "0.01", "PREFIX_CACHING": "0"},
    )  # fmt: skip
    engine = build_engine(config)
    prompts = ["hello world this is a test", "the quick brown fox jumps over the lazy dog",
               "one two three four five six seven", "a", "paged attention splits the cache into blocks",
               "every request completes"]  # fmt: skip
    max_new = 16

    async def scenario():
        router = await Router.connect(config.server.uds_path, str(tiny_llama), max_input_tokens=32,
                                      max_total_tokens=64, max_batch_prefill_tokens=64)  # fmt: skip
        try:
            assert router.info.block_size == 1
            assert router.info.max_batch_total_tokens == 4 * 64 and router.info.num_blocks == 4 * 64
            outputs = await run_requests(router, prompts, max_new)
            requests = prefill_requests(router.rpc_log)
            return outputs, requests, router.stats
        finally:
            await router.close()

    shard = InProcessShard(config, engine).start()
    try:
        outputs, requests, stats = run(scenario(), timeout=240)
    finally:
        assert shard.stop() == 0
    assert outputs == hf_greedy(tiny_llama, prompts, max_new)
    real = [r for r in requests if r.id != 2**64 - 1]
    assert len(real) == len(prompts)
    for r in real:  # per-token router blocks: prompt + max_new - 1 of them, slots == blocks
        num_prompt = len(engine.prompt_tokenizer.encode(r.inputs, r.truncate, True))
        assert len(r.blocks) == len(r.slots) == num_prompt + max_new - 1
        assert list(r.slots) == list(r.blocks) and 0 not in r.blocks
    assert stats.concurrency_peak >= 3
    assert sum(engine.stats.preemptions.values()) > 0, engine.stats.preemptions
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_swapped_blocks == 0
    engine.kv.check_invariants()
