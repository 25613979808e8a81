"""A long mixed run through a router-like loop: nothing leaks, invariants hold after every RPC.

24 requests with random prompt lengths, ``max_new_tokens`` (1..24, some sampled, some stopping at EOS)
and arrival times are admitted against the router's virtual pool and admission brake, join the running
batch (chunking: ``prefill(new, cached)``; non-chunking: separate prefill then ``decode([a, b])``),
are sometimes cancelled through FilterBatch, and share a physical pool small enough that requests are
preempted (recompute or swap). A liveness probe arrives now and then. At the end every physical block
is free or retained, swap space is empty, and greedy outputs equal HF.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.engine.conftest import (
    RouterBlocks,
    RouterDriver,
    make_engine,
    make_text,
    probe,
    prompt_ids,
    router_spec,
    router_warmup,
)
from tgi_paged_backend.engine.types import BatchSpec, FinishReason, RequestSpec, SamplingParams, StoppingParams

NUM_REQUESTS = 24


def workload(seed: int) -> list[tuple[int, RequestSpec]]:
    """(arrival step, request) pairs; router blocks are assigned at admission."""
    rng = random.Random(seed)
    out = []
    step = 0
    for i in range(NUM_REQUESTS):
        step += rng.choice((0, 0, 1, 2, 4))
        sampling = (
            SamplingParams(do_sample=True, temperature=0.8, top_k=20, seed=rng.randrange(2**64))
            if i % 5 == 3
            else SamplingParams()
        )
        out.append(
            (
                step,
                RequestSpec(
                    id=100 + i,
                    text=make_text(seed * 1000 + i, rng.randint(1, 12)),
                    truncate=10_000,
                    sampling=sampling,
                    top_n_tokens=2 if i % 7 == 0 else 0,
                    stopping=StoppingParams(max_new_tokens=rng.randint(1, 24), ignore_eos_token=i % 4 != 0),
                ),
            )
        )
    return out


@pytest.mark.parametrize(("preemption", "style"), [("recompute", "non_chunking"), ("swap", "chunking")])
def test_long_mixed_run_leaks_nothing(tiny_llama_dir, hf_greedy, preemption, style):
    engine = make_engine(tiny_llama_dir, num_blocks=12, preemption=preemption, TGI_PAGED_OVERCOMMIT="3")
    supported = router_warmup(engine, 32).max_supported_total_tokens
    engine.kv.check_invariants()
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    rng = random.Random(7)
    queue = workload(3)
    running = None
    cancelled: set[int] = set()
    next_batch_id = 1
    waiting_preempted_seen = 0
    for step in range(5000):
        if not queue and running is None:
            break
        # -- admission: the router's virtual pool and the shard's brake decide
        arrived = [r for at, r in queue if at <= step]
        if arrived and (running is None or running.max_tokens < supported):
            new = []
            for r in arrived[:3]:
                n = len(prompt_ids(engine, r.text)) + r.stopping.max_new_tokens - 1
                got = blocks.allocate(n)
                if got is None:
                    break
                new.append(dataclasses.replace(r, blocks=got[0], slots=got[1]))
            if new:
                queue = [(at, r) for at, r in queue if r.id not in {x.id for x in new}]
                batch = BatchSpec(id=next_batch_id, requests=tuple(new))
                next_batch_id += 1
                if running is None:
                    running = driver.prefill(batch)
                elif style == "chunking":
                    running = driver.prefill(batch, cached=running)
                else:
                    added = driver.prefill(batch)
                    if added is not None:
                        running = driver.decode([running, added])
                continue
        if running is None:
            continue
        # -- a client disconnects now and then: the router drops it and filters
        if rng.random() < 0.06 and len(running.request_ids) > 1:
            gone = rng.choice(running.request_ids)
            cancelled.add(gone)
            blocks.release(driver.entries.pop(gone).blocks)
            kept = [rid for rid in running.request_ids if rid != gone]
            running = engine.filter_batch(running.id, kept)
            engine.kv.check_invariants()
            assert running.request_ids == kept and gone not in engine.requests
        if step % 5 == 0:
            probe(engine)
        waiting_preempted_seen += any(r.is_preempted for r in engine.requests.values())
        running = driver.decode([running])
    else:
        raise AssertionError("the run did not finish")

    driver.assert_idle()
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_swapped_blocks == 0
    assert engine.kv.num_free_blocks + engine.kv.num_retained_blocks == engine.kv.num_total_blocks
    assert sorted(blocks.free) == list(range(1, engine.num_virtual_blocks))
    assert engine.stats.preemptions[preemption] > 0 and waiting_preempted_seen > 0
    finished = set(driver.final)
    assert finished | cancelled == {r.id for _, r in workload(3)} and not finished & cancelled
    for _, r in workload(3):
        if r.id in cancelled:
            continue
        final = driver.final[r.id].generated_text
        if r.sampling.is_sampling:
            continue
        want = hf_greedy(
            tiny_llama_dir,
            prompt_ids(engine, r.text),
            r.stopping.max_new_tokens,
            stop_at_eos=not r.stopping.ignore_eos_token,
        )
        assert driver.tokens[r.id] == want, f"request {r.id}"
        if final.finish_reason is FinishReason.EOS_TOKEN:
            assert not r.stopping.ignore_eos_token


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_heavily_preempted_requests_do_not_deadlock(tiny_llama_dir, preemption):
    # Valid router traffic: each request fits alone (<= max_total_tokens = 64 = the physical pool),
    # the four reservations fit the advertised (4x overcommitted) virtual pool.
    engine = make_engine(tiny_llama_dir, num_blocks=9, preemption=preemption, TGI_PAGED_OVERCOMMIT="4")
    result = router_warmup(engine, 32)
    blocks = RouterBlocks(engine)
    driver = RouterDriver(engine, blocks)
    requests = tuple(router_spec(engine, blocks, i, make_text(100 + i, 2), 40) for i in range(4))
    assert all(len(r.slots) <= result.max_total_tokens for r in requests)
    batch = driver.prefill(BatchSpec(id=0, requests=requests))
    idle = 0
    while batch is not None:
        batch = driver.decode([batch])
        idle = 0 if driver.results[-1].generations else idle + 1
        assert idle < 100, "no request made progress for 100 Decodes: deadlock " + repr(
            {
                rid: (r.status.value, r.num_preemptions, engine.kv.request_memory(rid).num_blocks)
                for rid, r in engine.requests.items()
            }
        )
    driver.assert_idle()
