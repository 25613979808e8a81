"""Bad input from the router: a clean ``InvalidRequestError`` / ``BatchNotFoundError``, nothing leaked.

Each case runs while another batch is cached mid-generation (as it would be in production). A call
that was not handed the running batch must leave it alone: it finishes with the same tokens as an
undisturbed run. A call that was handed it (a Decode of it, a Prefill carrying it as ``cached_batch``)
frees it, since the router fails every request it sent: nothing of it stays in the shard. Either way a
fresh request is then served with the same tokens as on an untouched engine, and the idle engine holds
no physical block (``kv.num_used_blocks == 0``).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.engine.conftest import RouterBlocks, RouterDriver, make_engine, make_text, router_spec, router_warmup, spec
from tgi_paged_backend.engine.types import (
    BatchNotFoundError,
    BatchSpec,
    GrammarSpec,
    InvalidRequestError,
    SamplingParams,
)

MAX_INPUT = 24


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir):
    """Tokens of the running requests when nothing goes wrong."""
    engine, driver, batch = start(tiny_llama_dir)
    driver.drain(batch)
    fresh = RouterDriver(engine, RouterBlocks(engine))
    fresh.run(BatchSpec(id=12, requests=(good(engine, fresh.blocks, 60),)))
    return dict(driver.tokens), fresh.tokens[60]


def start(model_dir):
    engine = make_engine(model_dir, num_blocks=24)
    result = router_warmup(engine, 32, max_input_tokens=MAX_INPUT, max_total_tokens=48)
    assert (result.max_input_tokens, result.max_total_tokens) == (MAX_INPUT, 48)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    running = (router_spec(engine, blocks, 1, make_text(90, 4), 8), router_spec(engine, blocks, 2, make_text(91, 2), 6))
    batch = driver.prefill(BatchSpec(id=10, requests=running))
    batch = driver.decode([batch])
    return engine, driver, batch


def good(engine, blocks, rid=50):
    return router_spec(engine, blocks, rid, make_text(92, 3), 4)


# Each case: (engine, router blocks, running CachedBatch) -> the bad call.
CASES = {
    "decode_unknown_batch": (BatchNotFoundError, lambda e, b, run: e.decode([run.id + 1000])),
    "decode_known_and_unknown_batch": (BatchNotFoundError, lambda e, b, run: e.decode([run.id, 777])),
    "bad_request_in_prefill_with_cached_batch": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(
            BatchSpec(id=11, requests=(good(e, b, 52), dataclasses.replace(good(e, b), text=""))), run.id
        ),
    ),
    "bad_grammar_in_prefill_with_cached_batch": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(
            BatchSpec(
                id=11,
                requests=(
                    dataclasses.replace(good(e, b), sampling=SamplingParams(grammar=GrammarSpec("regex", "(unclosed"))),
                ),
            ),
            run.id,
        ),
    ),
    "bad_json_schema": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(
            BatchSpec(
                id=11,
                requests=(
                    dataclasses.replace(
                        good(e, b), sampling=SamplingParams(grammar=GrammarSpec("json", '{"type": 5}'))
                    ),
                ),
            ),
            None,
        ),
    ),
    "filter_unknown_batch": (BatchNotFoundError, lambda e, b, run: e.filter_batch(777, [1])),
    "prefill_unknown_cached_batch": (
        BatchNotFoundError,
        lambda e, b, run: e.prefill(BatchSpec(id=11, requests=(good(e, b),)), 777),
    ),
    "empty_batch": (InvalidRequestError, lambda e, b, run: e.prefill(BatchSpec(id=11, requests=()), None)),
    "decode_no_batches": (InvalidRequestError, lambda e, b, run: e.decode([])),
    "slots_too_short": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(BatchSpec(id=11, requests=(short_slots(good(e, b)),)), None),
    ),
    "block_outside_advertised_range": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(
            BatchSpec(id=11, requests=(with_blocks(good(e, b), e.num_virtual_blocks, e.block_size),)), None
        ),
    ),
    "negative_block": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(BatchSpec(id=11, requests=(with_blocks(good(e, b), -1, e.block_size),)), None),
    ),
    "empty_text": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(
            BatchSpec(id=11, requests=(good(e, b, 52), dataclasses.replace(good(e, b), text=""))), None
        ),
    ),
    "duplicate_ids_in_batch": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(BatchSpec(id=11, requests=(good(e, b), good(e, b))), None),
    ),
    "request_id_already_live": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(BatchSpec(id=11, requests=(good(e, b, 52), good(e, b, run.request_ids[0]))), None),
    ),
    "chunk_len_zero": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(BatchSpec(id=11, requests=(dataclasses.replace(good(e, b), chunk_len=0),)), None),
    ),
    "prompt_longer_than_max_input_tokens": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(
            BatchSpec(id=11, requests=(spec(50, make_text(93, 30), 4, truncate=MAX_INPUT + 20),)), None
        ),
    ),
    "cache_len_equals_prompt": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(
            BatchSpec(
                id=11,
                requests=(
                    dataclasses.replace(good(e, b), cache_len=len(e.prompt_tokenizer.encode(make_text(92, 3), 10_000))),
                ),
            ),
            None,
        ),
    ),
    "temperature_zero": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(
            BatchSpec(id=11, requests=(dataclasses.replace(good(e, b), sampling=SamplingParams(temperature=0.0)),)),
            None,
        ),
    ),
    "top_p_above_one": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(
            BatchSpec(id=11, requests=(dataclasses.replace(good(e, b), sampling=SamplingParams(top_p=1.5)),)), None
        ),
    ),
    "max_new_tokens_zero": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(BatchSpec(id=11, requests=(spec(50, "Hello", 0),)), None),
    ),
}

# Regressions (fixed in the engine): each once left requests behind that no batch owned, or let one request stall
# the shard for good.
REGRESSIONS = {
    "decode_same_batch_twice": (
        InvalidRequestError,
        lambda e, b, run: e.decode([run.id, run.id]),
        "BUG shard_engine.decode: duplicate ids pass the `missing` check, the second "
        "self.batches.pop(b) raises a bare KeyError after the batch was already popped, and its requests "
        "are orphaned (in self.requests, in no batch: clear_cache(None) cannot free them either)",
    ),
    "duplicate_virtual_blocks": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(
            BatchSpec(id=11, requests=(good(e, b, 52), with_blocks(good(e, b), 7, e.block_size, repeat=True))), None
        ),
        "BUG validation.validate_request_spec does not reject repeated virtual blocks; "
        "KVCacheManager.add_request raises ValueError inside shard_engine._add_requests' registration "
        "loop, after the earlier requests of the batch were registered: they leak (no batch owns them)",
    ),
    "new_batch_reuses_the_cached_batch_id": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(BatchSpec(id=run.id, requests=(good(e, b),)), None),
        "BUG (found by tests/server/test_rpc_fuzz.py) shard_engine.prefill stored the new batch under an id "
        "that was already cached, replacing that batch: its requests kept their blocks, owned by no batch",
    ),
    "request_longer_than_the_pool_with_router_blocks": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(BatchSpec(id=11, requests=(router_spec(e, b, 53, make_text(92, 3), 200),)), None),
        "BUG (found by tests/server/test_rpc_fuzz.py) a request needing more blocks than the whole pool was "
        "accepted (its router reservation fits the overcommitted virtual space); once the oldest it preempted "
        "everyone and waited forever, and no request got a token again",
    ),
    "request_longer_than_the_pool_without_blocks": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(BatchSpec(id=11, requests=(spec(53, make_text(92, 3), 10_000),)), None),
        "BUG (found by tests/server/test_rpc_fuzz.py) the same without router blocks (nothing bounded it)",
    ),
    "ordinary_request_on_the_probes_block_zero": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(BatchSpec(id=11, requests=(with_blocks(good(e, b), 0, e.block_size),)), None),
        "BUG (noticed by the RPC fuzzer) virtual block 0, which the shard backs with its scratch block for the "
        "liveness probe, was accepted in an ordinary request: two such requests read each other's KV",
    ),
    "ordinary_request_with_the_probes_id": (
        InvalidRequestError,
        lambda e, b, run: e.prefill(BatchSpec(id=11, requests=(dataclasses.replace(good(e, b), id=2**64 - 1),)), None),
        "BUG (noticed by the RPC fuzzer) a live request with id U64_MAX made every liveness probe fail",
    ),
}


# Calls handed the running batch: the router fails (and forgets) its requests, so the shard frees them.
HANDS_RUNNING = {
    "decode_known_and_unknown_batch",
    "decode_same_batch_twice",
    "bad_request_in_prefill_with_cached_batch",
    "bad_grammar_in_prefill_with_cached_batch",
}


def short_slots(r):
    """The router reserved one slot less than the shard's prompt needs (tokenizers disagree)."""
    return dataclasses.replace(r, slots=r.slots[:-1])


def with_blocks(r, block: int, block_size: int, repeat: bool = False):
    """``r`` with its first virtual block replaced (or every block, ``repeat``), slots to match."""
    blocks = (block,) * len(r.blocks) if repeat else (block,) + r.blocks[1:]
    slots = tuple(b * block_size + o for b in blocks for o in range(block_size))[: len(r.slots)]
    return dataclasses.replace(r, blocks=blocks, slots=slots)


def check_bad_call(model_dir, baseline, error, call, hands_running: bool) -> None:
    running_tokens, fresh_tokens = baseline
    engine, driver, running = start(model_dir)
    live_before = dict(engine.batches)
    with pytest.raises(error):
        call(engine, RouterBlocks(engine), running)
    engine.kv.check_invariants()
    if hands_running:
        assert engine.batches == {} and engine.requests == {}, "a failed call left requests the router failed"
        assert engine.kv.num_used_blocks == 0 and engine.kv.num_swapped_blocks == 0
    else:
        assert engine.batches == live_before, "a rejected call changed the cached batches"
        assert sorted(engine.requests) == sorted(running.request_ids), "a rejected request was registered"
        driver.drain(running)
        assert driver.tokens == running_tokens, "the running batch was disturbed"
        driver.assert_idle()
    fresh = RouterDriver(engine, RouterBlocks(engine))
    fresh.run(BatchSpec(id=12, requests=(good(engine, fresh.blocks, 60),)))
    fresh.assert_idle()
    assert fresh.tokens[60] == fresh_tokens
    assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_rejected_without_side_effects(tiny_llama_dir, baseline, case):
    error, call = CASES[case]
    check_bad_call(tiny_llama_dir, baseline, error, call, case in HANDS_RUNNING)


@pytest.mark.parametrize("case", sorted(REGRESSIONS))
def test_bad_input_regressions(tiny_llama_dir, baseline, case):
    error, call, _ = REGRESSIONS[case]
    check_bad_call(tiny_llama_dir, baseline, error, call, case in HANDS_RUNNING)
