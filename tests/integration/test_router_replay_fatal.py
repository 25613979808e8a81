"""Router replay: each shard mistake that would kill (or silently corrupt) the stock router is loud."""

from __future__ import annotations

import asyncio

import pytest

from integration.router_replay import GenerateParameters, Router, RouterFatalError
from integration.router_replay.fake_shard import CharTokenizer, fake_shards
from tgi_paged_backend.server.pb import generate_pb2 as pb

LIMITS = dict(max_input_tokens=200, max_total_tokens=256, max_batch_prefill_tokens=512)


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def once(method, fn):
    """A ``FakeShard.mutate`` hook that rewrites the first response of ``method`` only."""
    done = []

    def mutate(m, request, response):
        if m == method and not done:
            done.append(True)
            fn(response)
        return response

    return mutate


def _first(response) -> pb.Generation:
    return response.generations[0]


def _drop_tokens(r):
    _first(r).ClearField("tokens")


def _unknown_id(r):
    tokens = pb.Tokens(ids=[5], logprobs=[0.0], texts=["x"], is_special=[False])
    r.generations.append(pb.Generation(request_id=999, tokens=tokens))


def _duplicate_final(r):
    r.generations.append(_first(r))


def _bad_finish(r):
    _first(r).generated_text.finish_reason = 7


def _unequal(r):
    del _first(r).tokens.is_special[:]


def _zero_tokens(r):
    _first(r).generated_text.generated_tokens = 0


def _two_tokens(r):
    t = _first(r).tokens
    t.ids.append(9), t.logprobs.append(-1.0), t.texts.append("z"), t.is_special.append(False)
    _first(r).generated_text.generated_tokens = 2


def _count_mismatch(r):
    _first(r).generated_text.generated_tokens = 5


def _vanish(r):
    del r.batch.request_ids[:]
    r.batch.size = 0


def _size(r):
    r.batch.size += 1


def _foreign(r):
    r.batch.request_ids.append(4242)
    r.batch.size += 1


def _prefill_tokens(r):
    _first(r).prefill_tokens.CopyFrom(pb.Tokens(ids=[1], logprobs=[0.0], texts=["<s>"]))


def _huge(r):
    _first(r).tokens.texts[0] = "x" * (5 * 1024 * 1024)


# (condition, strict, max_new_tokens, method, response rewrite)
CASES = [
    ("generation_without_tokens", True, 3, "Prefill", _drop_tokens),
    ("generation_without_tokens", False, 3, "Prefill", _drop_tokens),
    ("unknown_request_id", True, 3, "Prefill", _unknown_id),
    ("unknown_request_id", False, 3, "Decode", _unknown_id),
    ("unknown_request_id", False, 1, "Prefill", _duplicate_final),  # a generation after the final
    ("invalid_finish_reason", True, 1, "Prefill", _bad_finish),
    ("invalid_finish_reason", False, 1, "Prefill", _bad_finish),
    ("unequal_token_lists", True, 3, "Decode", _unequal),
    ("zero_generated_tokens", True, 1, "Prefill", _zero_tokens),
    ("too_many_tokens", True, 1, "Prefill", _two_tokens),
    ("generated_tokens_mismatch", True, 1, "Prefill", _count_mismatch),
    ("request_vanished", True, 3, "Decode", _vanish),
    ("cached_batch_size", True, 3, "Prefill", _size),
    ("foreign_request_id", True, 3, "Prefill", _foreign),
    ("unsolicited_prefill_tokens", True, 3, "Prefill", _prefill_tokens),
    ("response_too_large", True, 3, "Prefill", _huge),
]


@pytest.mark.parametrize("condition, strict, max_new_tokens, method, rewrite", CASES, ids=[
    f"{c[0]}-{'strict' if c[1] else 'stock'}-{c[3]}" for c in CASES
])  # fmt: skip
def test_fatal_condition(condition, strict, max_new_tokens, method, rewrite):
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS, strict=strict)
            shard.mutate = once(method, rewrite)
            stream = await router.generate("hello", GenerateParameters(max_new_tokens=max_new_tokens))
            try:
                await stream.collect()  # may complete first when the bad generation follows the final
            except RouterFatalError as err:
                assert err is router.fatal_error
            while router.fatal_error is None:
                await asyncio.sleep(0.002)
            assert router.fatal_error.condition == condition
            with pytest.raises(RouterFatalError):
                await router.generate("more", GenerateParameters(max_new_tokens=1))
            with pytest.raises(RouterFatalError):
                await router.close()

    run(body())


async def _running_pair(router, shard, new_a: int, new_b: int):
    """Two requests in one batch: a gated first Prefill lets both queue behind a warm-up request."""
    gate = shard.pause["Prefill"] = asyncio.Event()
    warm = await router.generate("w", GenerateParameters(max_new_tokens=1))
    while "Prefill" not in shard.methods():
        await asyncio.sleep(0.002)
    a = await router.generate("a", GenerateParameters(max_new_tokens=new_a))
    b = await router.generate("b", GenerateParameters(max_new_tokens=new_b))
    del shard.pause["Prefill"]
    gate.set()
    await warm.collect()
    return a, b


@pytest.mark.parametrize("strict", [True, False])
def test_failing_filter_batch_is_fatal(strict):
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS, strict=strict)
            shard.fail_next["FilterBatch"] = "filter exploded"
            a, b = await _running_pair(router, shard, 2, 50)
            with pytest.raises(RouterFatalError, match="filter exploded") as caught:
                await b.collect()
            assert caught.value.condition == "filter_batch_failed"
            await router.close(raise_fatal=False)

    run(body())


def test_filter_batch_without_batch_is_fatal():
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            shard.mutate = once("FilterBatch", lambda r: r.ClearField("batch"))
            a, b = await _running_pair(router, shard, 2, 50)
            with pytest.raises(RouterFatalError) as caught:
                await b.collect()
            assert caught.value.condition == "filter_batch_empty"
            await router.close(raise_fatal=False)

    run(body())


def test_failing_clear_cache_after_cancel_is_fatal():
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            stream = await router.generate("bye", GenerateParameters(max_new_tokens=200))
            await stream.__anext__()
            shard.fail_next["ClearCache"] = "clear exploded"
            await stream.aclose()
            while router.fatal_error is None:
                await asyncio.sleep(0.002)
            assert router.fatal_error.condition == "clear_cache_failed"
            with pytest.raises(RouterFatalError, match="clear exploded"):
                await router.health()
            await router.close(raise_fatal=False)

    run(body())


def test_liveness_probe_must_not_leave_a_batch():
    async def body():
        async with fake_shards() as (shard,):
            router = await Router.connect(shard.uds_base_path, CharTokenizer(), **LIMITS)
            router._backend_healthy = False  # as after a failed generation

            def keep(r):
                r.batch.CopyFrom(pb.CachedBatch(id=2**64 - 1, request_ids=[2**64 - 1], size=1))

            shard.mutate = once("Prefill", keep)
            with pytest.raises(RouterFatalError) as caught:
                await router.health()
            assert caught.value.condition == "liveness_batch_kept"
            await router.close()

    run(body())
